"""The beat scheduler (llmgw_site.beat.LeaderScheduler) in this process, on the test database:
what a standby does, and where a new leader starts its schedule from. Nothing is sent to a broker
here; tests/llmgw_site/test_two_control_planes.py runs two real beats against each other. One test
runs a beat process, to stop it in the middle of a query."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.db import connection
from django.utils import timezone

from llmgw_site import leader
from llmgw_site.beat import LeaderScheduler, PeriodicTask, interval_of
from llmgw_site.celery import app
from llmgw_site.models import Lease, PeriodicRun
from tests.support.system import ROOT
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[LeaderScheduler]:
    beat = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))
    # The lease path, on whichever database the tests use (on SQLite a beat never takes it).
    beat.shared = True
    yield beat
    beat.close()


def test_a_standby_sends_nothing_and_says_once_who_leads(
    scheduler: LeaderScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    leader.take(holder="the-other-machine", seconds=30)
    with caplog.at_level(logging.INFO, logger="llmgw.beat"):
        delays = [scheduler.tick() for _ in range(3)]
    assert delays == [2.0, 2.0, 2.0]  # asks again in 2 s
    assert not PeriodicRun.objects.exists()
    said = [r.getMessage() for r in caplog.records if "standing by" in r.getMessage()]
    assert said == [
        "beat: standing by; the-other-machine runs the schedule (this beat takes over if that "
        "one stops renewing its 15 s lease)"
    ]


def test_a_new_leader_starts_from_the_sends_recorded_by_the_last_one(
    scheduler: LeaderScheduler,
) -> None:
    now = timezone.now()
    PeriodicRun.objects.create(name="fold-traffic", task="access.tasks.fold_traffic",
                               sends=7, sent_at=now - timedelta(seconds=590))  # fmt: skip
    PeriodicRun.objects.create(name="check-updates", task="registry.tasks.check_updates",
                               sends=3, sent_at=now - timedelta(hours=7))  # fmt: skip

    assert scheduler._lead()

    # Every 10 minutes, last sent 590 s ago: due in about 10 s, not 10 minutes after this start.
    due, wait = scheduler.schedule["fold-traffic"].is_due()
    assert not due and 5 <= wait <= 11
    # Every 6 hours, last sent 7 hours ago (while no beat led): due now.
    due, _ = scheduler.schedule["check-updates"].is_due()
    assert due
    # Never sent by anyone: as Celery does, one interval after this beat's start.
    due, wait = scheduler.schedule["sample-capacity"].is_due()
    assert not due and wait > 50


def test_a_send_recorded_by_a_database_clock_ahead_does_not_hold_the_entry_back(
    scheduler: LeaderScheduler,
) -> None:
    # The database's clock five minutes ahead of this machine's: the last send it stamped is
    # in this beat's future. The entry comes due within its interval, not five minutes later.
    ahead = timezone.now() + timedelta(minutes=5)
    PeriodicRun.objects.create(name="reconcile", task="fleet.tasks.reconcile", sends=4,
                               sent_at=ahead)  # fmt: skip

    assert scheduler._lead()

    interval = interval_of(scheduler.schedule["reconcile"])
    due, wait = scheduler.schedule["reconcile"].is_due()
    assert due or wait <= interval


def test_after_the_clock_steps_back_every_entry_comes_due_within_its_interval(
    scheduler: LeaderScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler._follow_clock()  # the first tick: the clock as it is
    # Five minutes ago the clock read five minutes later than it does now: every entry's last
    # send, stamped then, is five minutes in the future.
    stamped = timezone.now() + timedelta(minutes=5)
    for entry in scheduler.schedule.values():
        entry.last_run_at = stamped
    assert scheduler._wall_offset is not None
    scheduler._wall_offset += 300

    with caplog.at_level(logging.INFO, logger="llmgw.beat"):
        scheduler._follow_clock()

    # (Celery's own daily clean-up is a crontab, due at a time of day: not one of these.)
    every = {n: e for n, e in scheduler.schedule.items() if not n.startswith("celery.")}
    assert "reconcile" in every
    for name, entry in every.items():
        interval = interval_of(entry)
        due, wait = entry.is_due()
        assert due or wait <= interval, (name, wait)
    assert scheduler._heap is None  # made again from the entries at the next tick
    assert any("the clock stepped by -300 s" in r.getMessage() for r in caplog.records)


def test_a_clock_that_only_drifts_changes_nothing(scheduler: LeaderScheduler) -> None:
    scheduler._follow_clock()
    later = timezone.now() + timedelta(minutes=5)
    scheduler.schedule["reconcile"].last_run_at = later
    scheduler._heap = []

    scheduler._follow_clock()

    assert scheduler.schedule["reconcile"].last_run_at == later
    assert scheduler._heap == []


def test_it_releases_the_lease_when_it_closes(tmp_path: Path) -> None:
    beat = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))
    beat.shared = True
    assert beat._lead()
    assert leader.holder_of().holder == beat.holder  # type: ignore[union-attr]
    beat.close()
    assert leader.holder_of().live is False  # type: ignore[union-attr]
    assert leader.take(holder="next", seconds=30) is not None


def _waiting_on_the_lease(url: str) -> list[str]:
    """The statements of other connections to this database that wait on a row lock of the
    lease table."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE %s AND pid <> pg_backend_pid()",
            [f'UPDATE "{Lease._meta.db_table}"%'],
        ).fetchall()
    return [query for (query,) in rows]


@pytest.mark.skipif(
    not os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://")),
    reason="the lease is taken on PostgreSQL only; a row lock holds the beat's query open",
)
def test_a_stop_signal_that_cuts_a_query_still_releases_the_lease_and_ends_the_beat(
    tmp_path: Path,
) -> None:
    """SIGTERM while the beat's renewal waits on the lease's row: the beat leaves the query,
    releases the lease on a new connection and exits (Celery's own handler released it inside
    the signal handler, on the connection the cut query held, and the beat hung)."""
    import psycopg

    table = Lease._meta.db_table
    url = urlunsplit(
        urlsplit(os.environ["DATABASE_URL"])._replace(path=f"/{connection.settings_dict['NAME']}")
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "LLMGW", "PYTEST"))},
        "DATABASE_URL": url,
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        "LLMGW_CONFIG": str(tmp_path / "server.yaml"),
        "LLMGW_CELERY_QUEUE": f"llmgw-beat-{uuid.uuid4().hex[:8]}",
        "LLMGW_BEAT_LEASE_SECONDS": "3",  # renewed every second
    }
    (tmp_path / "server.yaml").write_text("{}\n")
    log = tmp_path / "beat.log"
    with log.open("wb") as out:
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "llmgw_site", "beat", "--loglevel", "info",
             "--schedule", str(tmp_path / "schedule"), "--pidfile="],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(
            lambda: "runs the schedule now" in log.read_text(errors="replace"),
            timeout=60,
            what=f"the beat to take the lease (log: {log})",
        )
        with psycopg.connect(url) as blocker:  # a transaction, open until rolled back below
            blocker.execute(f"SELECT 1 FROM \"{table}\" WHERE name = 'beat' FOR UPDATE")
            wait_for(
                lambda: any('"term"' in query for query in _waiting_on_the_lease(url)),
                timeout=30,
                what="the beat's renewal to wait on the locked row",
            )
            beat.send_signal(signal.SIGTERM)
            # The release (which sets only the expiry) waits on the row in its turn.
            wait_for(
                lambda: any(
                    query.startswith(f'UPDATE "{table}" SET "expires_at"')
                    for query in _waiting_on_the_lease(url)
                ),
                timeout=15,
                what=f"the stopping beat's release to reach the database (log: {log})",
            )
            blocker.rollback()
        assert beat.wait(timeout=30) == 0
        assert "released the lease" in log.read_text(errors="replace")
        assert leader.holder_of().live is False  # type: ignore[union-attr]
    finally:
        if beat.poll() is None:
            beat.kill()
            beat.wait()


def test_every_task_is_a_periodic_task() -> None:
    """So that a worker runs each periodic send once (PeriodicTask.before_start)."""
    app.loader.import_default_modules()
    ours = [task for name, task in app.tasks.items() if not name.startswith("celery.")]
    assert ours and all(isinstance(task, PeriodicTask) for task in ours)
