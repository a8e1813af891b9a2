"""The autoscale policy: how it is set and refused, and what the autoscaler decides from the
gateways' queue figures (LoadSignal rows, written here by the gateway's own LoadSignalBook)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from catalog.models import AuditEntry, Model
from catalog.services import model_autoscale, model_scale
from core import metrics as core_metrics
from core.refusals import Refused
from fleet import autoscale
from fleet.autoscale import SIGNAL_FRESH_SECONDS, wait_quantile
from fleet.models import LoadSignal, Replica
from fleet.reconciler import reconcile_pass
from gateway.fairqueue import FairQueue
from gateway.loadsignal import LoadSignalBook

pytestmark = pytest.mark.django_db

POLICY = {"wait": "2s", "up_after": "30s", "down_after": "2m"}


def served(fleet: Any, model: str, count: int) -> None:
    """Every replica of `model` reported ready, until it has `count` of them."""
    for _ in range(6):
        reconcile_pass()
        for node in {r.node.name for r in Replica.objects.select_related("node")}:
            fleet.beat(node)
        if len([r for r in fleet.replicas(model) if r.routable]) == count:
            return
    raise AssertionError(f"{model} did not get {count} ready replicas")


def report(writer: str, at: datetime, model: str, *, waits: list[float], **live: int) -> None:
    """One gateway process's row: the waits that ended (through its LoadSignalBook, as the
    fair queue's on_wait reports them) and what is in service and waiting now."""
    book = LoadSignalBook(FairQueue(None), writer)
    for seconds in waits:
        book.wait(model, seconds, "served")
    figures = book.figures()
    figures.setdefault(model, {"waits": [0] * len(autoscale.WAIT_BOUNDS)})
    figures[model].update({"waiting": 0, "in_service": 0, **live})
    LoadSignal.objects.update_or_create(writer=writer, defaults={"at": at, "figures": figures})


def describe(refused: Refused) -> str:
    return " ".join([refused.message, *(f"{p.field}: {p.message}" for p in refused.problems)])


def decide(model: str, now: datetime) -> dict[str, Any]:
    models = list(Model.objects.all())
    autoscale.evaluate(now, models, 900)
    return Model.objects.get(name=model).autoscale_state


def wanted(model: str, now: datetime) -> int:
    return Model.objects.get(name=model).desired_replicas(now, 900)


@pytest.fixture
def chat(fleet: Any) -> Model:
    fleet.node("a", memory_gb=16, cores=8)
    fleet.add("chat", min_replicas=1, max_replicas=3)
    served(fleet, "chat", 1)
    return model_autoscale(actor=fleet.owner, name="chat", policy=POLICY)


def test_a_policy_is_stored_shown_and_audited(fleet: Any, chat: Model) -> None:
    assert chat.autoscale == {"wait": 2, "up_after": 30, "down_after": 120}
    assert chat.definition()["autoscale"] == {"wait": "2s", "up_after": "30s", "down_after": "2m"}
    assert AuditEntry.objects.filter(action="autoscale", model_name="chat").exists()
    off = model_autoscale(actor=fleet.owner, name="chat", policy=None)
    assert off.autoscale is None and "autoscale" not in off.definition()


@pytest.mark.parametrize(
    ("policy", "words"),
    [
        ({"wait": "soon"}, "'soon' is not a duration"),
        ({"wait": "0"}, "must be from 1s to 10m"),
        ({"wait": "2s", "up_after": "1s"}, "must be at least 10s"),
        ({"wait": "2s", "bogus": "1"}, "bogus"),
    ],
)
def test_a_wrong_policy_is_refused_and_changes_nothing(
    fleet: Any, chat: Model, policy: dict[str, str], words: str
) -> None:
    with pytest.raises(Refused) as refused:
        model_autoscale(actor=fleet.owner, name="chat", policy=policy)
    assert words in describe(refused.value)
    assert Model.objects.get(name="chat").autoscale == chat.autoscale


def test_a_model_without_room_above_its_floor_is_refused_a_policy(fleet: Any) -> None:
    fleet.add("fixed", min_replicas=2)
    with pytest.raises(Refused) as refused:
        model_autoscale(actor=fleet.owner, name="fixed", policy=POLICY)
    assert "with min 2 and no max there is no room to scale" in describe(refused.value)
    assert Model.objects.get(name="fixed").autoscale is None


def test_a_wait_over_the_target_for_the_up_window_adds_one_replica(fleet: Any, chat: Model) -> None:
    core_metrics.reset_for_tests()
    start = timezone.now()
    for offset in (0, 10, 20):
        now = start + timedelta(seconds=offset)
        report("gw-1", now, "chat", waits=[3.0, 4.0, 5.0], waiting=2, in_service=1)
        state = decide("chat", now)
        assert state["replicas"] == 1 and wanted("chat", now) == 1
        assert "queue wait p50" in state["why"] and "of the 30s it takes to add one" in state["why"]
    now = start + timedelta(seconds=30)
    report("gw-1", now, "chat", waits=[3.0, 4.0, 5.0], waiting=2, in_service=1)
    state = decide("chat", now)
    assert state["replicas"] == 2 and wanted("chat", now) == 2
    assert (
        state["why"].startswith("2 of max 3: queue wait p50") and "over 2s for 30s" in state["why"]
    )
    [entry] = AuditEntry.objects.filter(action="autoscale", actor_name="system")
    assert entry.note.startswith("up to 2: queue wait p50")
    assert entry.after["figures"]["waiting"] == 2
    steps = core_metrics.control_metrics().autoscale_steps.labels("chat", "up")
    assert steps._value.get() == 1

    # The next step waits for the new replica to serve, then for a whole window again.
    later = now + timedelta(seconds=40)
    report("gw-1", later, "chat", waits=[6.0, 6.0, 6.0])
    state = decide("chat", later)
    assert state["replicas"] == 2 and "waiting for its replicas to be ready" in state["why"]
    served(fleet, "chat", 2)


def test_a_step_never_passes_the_max(fleet: Any, chat: Model) -> None:
    model_scale(actor=fleet.owner, name="chat", min_replicas=1, max_replicas=1)
    now = timezone.now()
    for offset in (0, 60):
        report("gw-1", now + timedelta(seconds=offset), "chat", waits=[9.0] * 3)
        state = decide("chat", now + timedelta(seconds=offset))
    assert state["replicas"] == 1 and state["why"].endswith("at its max")


def test_a_spare_replica_unused_for_the_down_window_is_removed_but_never_below_the_floor(
    fleet: Any, chat: Model
) -> None:
    Model.objects.filter(pk=chat.pk).update(autoscale_state={"replicas": 3})
    served(fleet, "chat", 3)
    start = timezone.now()
    # Slots are 1 a replica: 1 in service of 3 leaves two replicas' worth unused.
    for offset in (0, 60):
        report("gw-1", start + timedelta(seconds=offset), "chat", waits=[0, 0], in_service=1)
        assert decide("chat", start + timedelta(seconds=offset))["replicas"] == 3
    now = start + timedelta(seconds=120)
    report("gw-1", now, "chat", waits=[0, 0], in_service=1)
    state = decide("chat", now)
    assert state["replicas"] == 2 and "1 of 3 slots in use, nobody waiting" in state["why"]
    assert AuditEntry.objects.get(action="autoscale", actor_name="system").note.startswith(
        "down to 2"
    )
    # One step per window: the next down step needs a whole window from this one.
    soon = now + timedelta(seconds=60)
    report("gw-1", soon, "chat", waits=[], in_service=0)
    assert decide("chat", soon)["replicas"] == 2
    for offset in (121, 250, 400):
        at = now + timedelta(seconds=offset)
        report("gw-1", at, "chat", waits=[], in_service=0)
        state = decide("chat", at)
    assert state["replicas"] == 1  # the floor: min 1
    assert "no requests lately" in state["why"]


def test_two_gateways_count_as_one(fleet: Any, chat: Model) -> None:
    Model.objects.filter(pk=chat.pk).update(autoscale_state={"replicas": 2})
    served(fleet, "chat", 2)
    start = timezone.now()
    # Each alone holds 2 of the 2 slots in service: one replica's worth would do for either;
    # together they hold 4, and nothing is spare.
    for offset in (0, 130):
        at = start + timedelta(seconds=offset)
        report("gw-1", at, "chat", waits=[0], in_service=1)
        report("gw-2", at, "chat", waits=[0], in_service=1)
        state = decide("chat", at)
    assert state["replicas"] == 2 and state["figures"]["in_service"] == 2
    assert "within 2s" in state["why"]
    # And a gateway that stopped writing counts for nothing after SIGNAL_FRESH_SECONDS.
    at = start + timedelta(seconds=140)
    report("gw-1", at, "chat", waits=[0], in_service=1)
    LoadSignal.objects.filter(writer="gw-2").update(
        at=at - timedelta(seconds=SIGNAL_FRESH_SECONDS + 1)
    )
    assert decide("chat", at)["figures"]["in_service"] == 1


def test_without_any_row_nothing_is_decided_and_stale_rows_are_no_load(
    fleet: Any, chat: Model
) -> None:
    now = timezone.now()
    state = decide("chat", now)
    assert state["replicas"] == 1 and "no gateway has reported its queue" in state["why"]
    # An idle gateway writes nothing: its last row goes stale, and counts as nothing asked.
    report("gw-1", now - timedelta(minutes=5), "chat", waits=[9.0] * 5, waiting=4)
    state = decide("chat", now)
    assert state["figures"]["waiting"] == 0 and "no requests lately" in state["why"]


def test_without_a_policy_the_count_is_the_floor_whatever_the_wait(fleet: Any) -> None:
    fleet.node("a", memory_gb=16, cores=8)
    fleet.add("plain", min_replicas=1, max_replicas=3)
    served(fleet, "plain", 1)
    start = timezone.now()
    for offset in range(0, 300, 10):
        report("gw-1", start + timedelta(seconds=offset), "plain", waits=[30.0] * 5, waiting=9)
        decide("plain", start + timedelta(seconds=offset))
    assert Model.objects.get(name="plain").autoscale_state is None
    assert wanted("plain", start) == 1
    assert not AuditEntry.objects.filter(action="autoscale", actor_name="system").exists()


def test_the_quantile_of_the_buckets() -> None:
    counts = [0] * len(autoscale.WAIT_BOUNDS)
    assert wait_quantile(counts, 0.5) is None
    counts[0] = 3  # three did not wait
    counts[autoscale.wait_bucket(5.0)] = 2  # (4, 8]
    assert wait_quantile(counts, 0.5) == 0.0
    counts[autoscale.wait_bucket(5.0)] = 7
    assert 4.0 < wait_quantile(counts, 0.5) <= 8.0
