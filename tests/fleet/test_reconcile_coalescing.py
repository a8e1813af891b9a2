"""Kicked passes coalesce, and periodic passes keep to a duty cycle (fleet.reconciler.reconcile_wanted):
a burst of changes makes one pass, not one each, and a large fleet's idle passes stay cheap, while a
silent node is still declared lost in time."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from fleet import tasks
from fleet.models import Node, ReconcileRun, Replica
from fleet.reconciler import (
    DUTY_FACTOR,
    KICK_DUTY_FACTOR,
    kick_wait,
    reconcile_pass,
    reconcile_wanted,
)
from tests.support.fleet import Fleet

pytestmark = [pytest.mark.django_db]


def test_the_first_pass_always_runs() -> None:
    assert reconcile_wanted(None, timezone.now())
    assert reconcile_wanted(timezone.now(), timezone.now())


def test_a_kick_is_served_by_any_pass_that_started_after_it(fleet: Fleet) -> None:
    fleet.node("n1")
    kicked = timezone.now()
    fleet.add("m", min_replicas=1, max_replicas=1)
    assert not reconcile_pass(kicked_at=timezone.now()).skipped  # placed m
    assert Replica.objects.count() == 1
    # Kicks from before that pass started (a burst of heartbeats) find nothing to do.
    assert reconcile_pass(kicked_at=kicked).skipped
    assert not reconcile_pass(kicked_at=timezone.now() + timedelta(seconds=1)).skipped


def test_the_task_takes_the_kick_time_as_text(fleet: Fleet) -> None:
    fleet.node("n1")
    tasks.reconcile(kicked_at=timezone.now().isoformat())
    first = ReconcileRun.objects.get()
    tasks.reconcile(kicked_at=(first.started_at - timedelta(seconds=1)).isoformat())
    assert ReconcileRun.objects.get().started_at == first.started_at  # skipped
    tasks.reconcile(kicked_at="not a time")  # taken as no kick time: a pass
    assert ReconcileRun.objects.get().started_at > first.started_at


def test_a_kick_that_finds_another_pass_running_asks_again_until_a_pass_serves_it(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass over thousands of replicas takes seconds; a model added meanwhile must not wait
    for the periodic pass, five of those durations later (bench/fleet.py: 3,000 replicas
    placed 46 s after the 17,000 of the pass that was running when their models were added)."""
    from fleet.reconciler import claim_lease, release_lease

    fleet.node("n1")
    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(
        tasks.reconcile,
        "apply_async",
        lambda kwargs, countdown: asked.append(kwargs | {"in": countdown}),
    )
    assert claim_lease("reconcile", "another-pass", 120)
    kicked = timezone.now().isoformat()
    fleet.add("m", min_replicas=1, max_replicas=1)
    tasks.reconcile(kicked_at=kicked)
    assert asked == [{"kicked_at": kicked, "in": tasks.BUSY_RETRY_SECONDS}]
    assert Replica.objects.count() == 0
    # A kick older than a lease is left to the periodic pass (a pass that died holding it).
    tasks.reconcile(kicked_at=(timezone.now() - tasks.BUSY_GIVE_UP).isoformat())
    assert len(asked) == 1
    release_lease("reconcile", "another-pass")
    tasks.reconcile(kicked_at=kicked)  # asked again: the lease is free, a pass serves it
    assert Replica.objects.count() == 1 and len(asked) == 1


def test_a_kicked_pass_waits_twice_the_last_passs_duration_after_its_start(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reports of replicas ready kick a pass every half second while a model is placed over
    thousands of nodes; passes of seconds each must not run back to back (a whole core)."""
    fleet.node("n1")
    now = timezone.now()
    assert kick_wait(now, now) == 0  # no pass yet
    ReconcileRun.objects.create(started_at=now - timedelta(seconds=1), seconds=3.0)
    assert KICK_DUTY_FACTOR == 2
    assert kick_wait(now, now) == pytest.approx(5.0)  # started 1 s ago, may start again at 6 s
    assert kick_wait(now - timedelta(seconds=2), now) == 0  # that pass started after the kick
    assert kick_wait(now, now + timedelta(seconds=10)) == 0

    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(
        tasks.reconcile,
        "apply_async",
        lambda kwargs, countdown: asked.append(kwargs | {"in": countdown}),
    )
    fleet.add("m", min_replicas=1, max_replicas=1)
    # The last pass stamped again just before the kick: adding the model may take a while.
    ReconcileRun.objects.filter(pk=1).update(started_at=timezone.now() - timedelta(seconds=1))
    kicked = timezone.now().isoformat()
    tasks.reconcile(kicked_at=kicked)
    # Asked again once the pace allows, and no pass ran meanwhile.
    assert len(asked) == 1 and asked[0]["kicked_at"] == kicked
    assert 4.0 < asked[0]["in"] <= 5.0
    assert Replica.objects.count() == 0
    # Once the last pass is far enough behind, the kick runs its pass.
    ReconcileRun.objects.filter(pk=1).update(started_at=timezone.now() - timedelta(seconds=7))
    tasks.reconcile(kicked_at=kicked)
    assert Replica.objects.count() == 1 and len(asked) == 1


def test_a_kick_that_finds_a_long_pass_running_asks_again_once_it_is_likely_done(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not every second: kicks every half second, each asking again every second while a pass
    of tens of seconds ran, took a third of the worker's time during a placement."""
    from fleet.reconciler import claim_lease

    fleet.node("n1")
    asked: list[float] = []
    monkeypatch.setattr(
        tasks.reconcile, "apply_async", lambda kwargs, countdown: asked.append(countdown)
    )
    # The last pass took 12 s; the one holding the lease began 2 s ago.
    ReconcileRun.objects.create(started_at=timezone.now() - timedelta(seconds=60), seconds=12.0)
    assert claim_lease("reconcile", "another-pass", 120, now=timezone.now() - timedelta(seconds=2))
    tasks.reconcile(kicked_at=timezone.now().isoformat())
    (wait,) = asked
    assert 9.0 < wait <= 10.0
    # A pass running longer than the last one took: asked again a second on, not at once.
    ReconcileRun.objects.filter(pk=1).update(seconds=1.0)
    tasks.reconcile(kicked_at=timezone.now().isoformat())
    assert asked[1] == tasks.BUSY_RETRY_SECONDS


def test_a_periodic_pass_waits_a_few_of_the_last_durations(fleet: Fleet) -> None:
    fleet.node("n1")
    now = timezone.now()
    ReconcileRun.objects.create(started_at=now - timedelta(seconds=5), seconds=2.0)
    assert DUTY_FACTOR * 2.0 > 5
    assert reconcile_pass(periodic=True).skipped
    ReconcileRun.objects.filter(pk=1).update(started_at=now - timedelta(seconds=11))
    assert not reconcile_pass(periodic=True).skipped


def test_a_periodic_pass_too_soon_still_declares_a_silent_node_lost(
    fleet: Fleet, settings: Any
) -> None:
    fleet.node("n1")
    fleet.node("n2")
    fleet.add("m", min_replicas=2, max_replicas=2)
    reconcile_pass()
    now = timezone.now()
    # n1 went silent past node_lost_after (30 s) while n2 kept heartbeating.
    Node.objects.update(heard_since=now - timedelta(minutes=5))
    Node.objects.filter(name="n1").update(last_heartbeat=now - timedelta(seconds=40))
    ReconcileRun.objects.filter(pk=1).update(started_at=now, seconds=60)  # a pass just ran
    report = reconcile_pass(periodic=True)
    assert not report.skipped and report.nodes_lost == ["n1"]
    assert Node.objects.get(name="n1").lost
    assert not Replica.objects.filter(node__name="n1", withdrawn_at__isnull=True).exists()


def test_the_kicks_of_a_burst_queue_one_pass_after_it(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleet import receivers

    settings.LLMGW_KICK_RECONCILE = True
    queued: list[dict[str, Any]] = []
    monkeypatch.setattr(
        receivers.reconcile, "apply_async", lambda **options: queued.append(options)
    )
    kicks = receivers.Kicks()
    before = timezone.now()
    for _ in range(50):  # fifty nodes reporting a replica ready in the same moment
        kicks.kick_reconcile(sender=Node)
    (first,) = queued
    assert first["countdown"] == receivers.KICK_WINDOW_SECONDS
    # Its kick time is the window's end: a pass that starts later saw every change of it.
    kicked_at = datetime.fromisoformat(first["kwargs"]["kicked_at"])
    assert kicked_at >= before + timedelta(seconds=receivers.KICK_WINDOW_SECONDS)
    kicks.window_ends = 0.0  # the window is over
    kicks.kick_reconcile(sender=Node)
    assert len(queued) == 2


def test_a_kick_the_broker_refused_is_tried_again_at_the_next_change(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleet import receivers

    settings.LLMGW_KICK_RECONCILE = True
    calls: list[int] = []

    def refuse(**options: Any) -> None:
        calls.append(1)
        raise ConnectionError("the broker is away")

    monkeypatch.setattr(receivers.reconcile, "apply_async", refuse)
    kicks = receivers.Kicks()
    kicks.kick_reconcile(sender=Node)
    kicks.kick_reconcile(sender=Node)
    assert len(calls) == 2
