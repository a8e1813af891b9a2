"""The beat scheduler (llmgw_site.beat.LeaderScheduler) in this process, on the test database:
what a standby does, and where a new leader starts its schedule from. Nothing is sent to a broker
here; tests/llmgw_site/test_two_control_planes.py runs two real beats against each other."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from llmgw_site import leader
from llmgw_site.beat import LeaderScheduler, PeriodicTask
from llmgw_site.celery import app
from llmgw_site.models import PeriodicRun

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
    PeriodicRun.objects.create(name="fold-traffic", task="gateway.tasks.fold_traffic",
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


def test_it_releases_the_lease_when_it_closes(tmp_path: Path) -> None:
    beat = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))
    beat.shared = True
    assert beat._lead()
    assert leader.holder_of().holder == beat.holder  # type: ignore[union-attr]
    beat.close()
    assert leader.holder_of().live is False  # type: ignore[union-attr]
    assert leader.take(holder="next", seconds=30) is not None


def test_every_task_is_a_periodic_task() -> None:
    """So that a worker runs each periodic send once (PeriodicTask.before_start)."""
    app.loader.import_default_modules()
    ours = [task for name, task in app.tasks.items() if not name.startswith("celery.")]
    assert ours and all(isinstance(task, PeriodicTask) for task in ours)
