"""A fetch whose worker died is taken over as soon as that is known (issue 44, item 5): its lease
lapsed (LEASE_SECONDS without renewal), or its process gone from this machine; a live holder's
fetch never is, however slow its download, and a holder that lost its lease stops writing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import OperationalError, connection
from django.utils import timezone

from core.actor import Actor
from registry import fetches, holders, mirror
from registry import models as registry_models
from registry.models import LEASE_SECONDS, RENEW_SECONDS, Fetch
from registry.updates import serve_start
from tests.registry.serving import REPO
from tests.support.registry import LocalRegistry, available
from tests.support.waiting import wait_for

# What the fault matrix measures from the kill to the fetch resumed: at most a lease, then the
# pass that queues it again (beat's advance-rollouts) and a worker claiming it.
RECOVERY_BOUND_SECONDS = 20

ELSEWHERE = "another-machine|1|4242|99"

needs_registry = pytest.mark.skipif(available() is not None, reason=str(available()))


def live_process() -> subprocess.Popen[bytes]:
    """A process of this machine that lives until its input closes (or it is killed)."""
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )


def dead_holder() -> str:
    """The holder name of a process of this machine that has ended."""
    process = live_process()
    holder = holders.of_process(process.pid)
    process.kill()
    process.wait()
    return holder


def test_it_renews_well_within_the_lease_and_takes_over_within_the_bound() -> None:
    assert RENEW_SECONDS * 3 <= LEASE_SECONDS
    period = settings.CELERY_BEAT_SCHEDULE["advance-rollouts"]["schedule"]
    assert LEASE_SECONDS + period <= RECOVERY_BOUND_SECONDS - 5  # 5 s for a worker to claim it


def test_it_tells_a_gone_process_of_this_machine_from_a_live_one_or_another_machines() -> None:
    assert not holders.is_gone(holders.this_process())
    alive = live_process()
    try:
        assert not holders.is_gone(holders.of_process(alive.pid))
    finally:
        alive.kill()
        alive.wait()
    assert holders.is_gone(holders.of_process(alive.pid))
    assert holders.is_gone(dead_holder())
    assert not holders.is_gone(ELSEWHERE)  # its lease decides
    assert not holders.is_gone("a name of another shape")
    # A pid used again by a later process: its start time tells them apart.
    host, namespace, pid, start = holders.this_process().split("|")
    assert holders.is_gone(f"{host}|{namespace}|{pid}|{int(start) - 1}")


@pytest.mark.django_db
def test_it_takes_over_a_fetch_whose_lease_lapsed_and_only_then() -> None:
    fetch = Fetch.objects.create(repo="r", commit="c" * 40, serve_definition={"name": "m"})
    claimed_at = timezone.now()
    assert Fetch.claim(fetch.pk, holder=ELSEWHERE, now=claimed_at)
    alive_still = claimed_at + timedelta(seconds=LEASE_SECONDS - 1)
    assert not Fetch.claim(fetch.pk, holder="b", now=alive_still)
    assert fetches.resume_interrupted(now=alive_still) == []
    lapsed = claimed_at + timedelta(seconds=LEASE_SECONDS + 1)
    assert fetches.resume_interrupted(now=lapsed) == [fetch.pk]
    fetch.refresh_from_db()
    assert (fetch.state, fetch.holder) == (Fetch.QUEUED, "")
    assert Fetch.claim(fetch.pk, holder="b", now=lapsed)
    assert not Fetch.claim(fetch.pk, holder="c", now=lapsed)  # one worker of two
    # An update's fetch (no serve definition) is claimed straight from its lapsed lease.
    update = Fetch.objects.create(repo="r", commit="d" * 40)
    assert Fetch.claim(update.pk, holder=ELSEWHERE, now=claimed_at)
    assert not Fetch.objects.get(pk=update.pk).is_claimable(alive_still)
    assert Fetch.objects.get(pk=update.pk).is_claimable(lapsed)
    assert Fetch.claim(update.pk, holder="b", now=lapsed)


@needs_registry
@pytest.mark.django_db
def test_it_takes_back_at_once_a_fetch_whose_process_is_gone(
    registry: LocalRegistry, alice: Actor
) -> None:
    fetch = serve_start(actor=alice, repo=REPO)
    gone = dead_holder()
    assert Fetch.claim(fetch.pk, holder=gone)  # its lease is fresh: only the pid tells
    assert not mirror.claim_fetch(fetch.pk)
    assert fetches.release_abandoned() == [fetch.pk]
    assert fetches.release_abandoned() == []  # taken back once
    fetch.refresh_from_db()
    assert (fetch.state, fetch.holder) == (Fetch.QUEUED, "")
    fetches.run_fetch(fetch.pk)  # what the queued message does
    fetch.refresh_from_db()
    assert fetch.state == Fetch.DONE, fetch.message


@pytest.mark.django_db
def test_it_never_takes_over_a_live_holders_fetch() -> None:
    now = timezone.now()
    alive = live_process()
    try:
        for holder in (holders.this_process(), holders.of_process(alive.pid), ELSEWHERE):
            fetch = Fetch.objects.create(repo=holder, commit="c" * 40, serve_definition={})
            assert Fetch.claim(fetch.pk, holder=holder, now=now)
            assert fetches.release_abandoned(now=now) == []
            assert fetches.resume_interrupted(now=now + timedelta(seconds=LEASE_SECONDS)) == []
            assert not Fetch.claim(fetch.pk, holder="b", now=now + timedelta(seconds=LEASE_SECONDS))
            assert Fetch.objects.get(pk=fetch.pk).holder == holder
    finally:
        alive.kill()
        alive.wait()


# -- the lease kept by a running download, in a worker thread with its own connection ----------


def download_in_a_thread(fetch_id: int, result: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            result["taken"] = mirror.claim_fetch(fetch_id)
            result["downloaded"] = mirror.download(fetch_id, claimed=True)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.fixture
def short_lease(monkeypatch: pytest.MonkeyPatch) -> float:
    """A lease of 1 s renewed every 0.2 s, so that a stall of 2 s outlasts it."""
    monkeypatch.setattr(registry_models, "LEASE_SECONDS", 1)
    monkeypatch.setattr(mirror, "RENEW_SECONDS", 0.2)
    return 1.0


def stalling(monkeypatch: pytest.MonkeyPatch, seconds: float) -> threading.Event:
    """Each file's download waits `seconds` before it starts (a registry slow to answer)."""
    started = threading.Event()
    original = mirror._download_file

    def slow(*args: Any, **kwargs: Any) -> int:
        started.set()
        time.sleep(seconds)  # the time itself is what is tested: a stall longer than the lease
        return original(*args, **kwargs)

    monkeypatch.setattr(mirror, "_download_file", slow)
    return started


@needs_registry
@pytest.mark.django_db(transaction=True)
def test_a_download_that_stalls_longer_than_the_lease_keeps_it(
    registry: LocalRegistry, alice: Actor, monkeypatch: pytest.MonkeyPatch, short_lease: float
) -> None:
    fetch = serve_start(actor=alice, repo=REPO)
    started = stalling(monkeypatch, 2 * short_lease)
    result: dict[str, Any] = {}
    worker = download_in_a_thread(fetch.pk, result)
    assert started.wait(10)
    while worker.is_alive():
        assert not Fetch.claim(fetch.pk, holder="b"), "a live holder's fetch was taken over"
        assert fetches.resume_interrupted() == []
        worker.join(0.05)  # again as soon as it ends, else every 50 ms while it stalls
    assert result == {"taken": True, "downloaded": True}
    assert Fetch.objects.get(pk=fetch.pk).state == Fetch.DONE


@needs_registry
@pytest.mark.django_db(transaction=True)
def test_a_holder_that_lost_its_lease_stops_and_writes_nothing(
    registry: LocalRegistry, alice: Actor, monkeypatch: pytest.MonkeyPatch, short_lease: float
) -> None:
    fetch = serve_start(actor=alice, repo=REPO)
    started = stalling(monkeypatch, 4 * short_lease)
    away = threading.Event()
    renew = Fetch.renew

    def renew_unless_away(self: Fetch) -> bool:
        if away.is_set():
            raise OperationalError("the database system is shutting down")
        return renew(self)

    monkeypatch.setattr(Fetch, "renew", renew_unless_away)
    result: dict[str, Any] = {}
    worker = download_in_a_thread(fetch.pk, result)
    assert started.wait(10)
    # Out of the database's reach longer than its lease: another worker takes the fetch over.
    away.set()
    wait_for(
        lambda: Fetch.claim(fetch.pk, holder="b"),
        timeout=10 * short_lease,
        what="another worker to take the fetch over once its lease lapsed",
    )
    away.clear()  # its next renewal finds the lease lost: it stops before its download goes on
    worker.join(30)
    assert result == {"taken": True, "downloaded": False}
    after = Fetch.objects.get(pk=fetch.pk)
    assert (after.state, after.holder, after.bytes_done) == (Fetch.RUNNING, "b", 0)
    assert not list(Path(mirror.root()).rglob("*.gguf"))  # nothing placed by the loser
