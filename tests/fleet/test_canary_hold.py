"""The reconciler during a canary update: one replica of the new weights beside all the old ones,
until the canary is promoted (the replacement goes on) or rolled back (the canary leaves)."""

from __future__ import annotations

from typing import Any

import pytest

from catalog.models import Model
from fleet.reconciler import reconcile_pass
from fleet.specs import current_keys, weights_revision
from tests.fleet.test_reconciler import settle

pytestmark = pytest.mark.django_db

NEW_SOURCE = "http://127.0.0.1:8000/mirror/acme/chat/4567def/chat.gguf"
CANARY = {"state": "watching", "revision": weights_revision(NEW_SOURCE, None), "percent": 10}


def fresh_and_stale(fleet: Any) -> tuple[int, int]:
    keys = current_keys(Model.objects.get(name="chat"))
    replicas = fleet.replicas("chat")
    fresh = sum(r.spec_key == keys[r.profile] for r in replicas)
    return fresh, len(replicas) - fresh


def canary_update(fleet: Any, *, nodes_memory_gb: float = 8, cores: float = 4) -> str:
    """chat on two replicas, then moved to new files with a canary, as an update's swap does;
    returns the old source."""
    fleet.node("a", memory_gb=nodes_memory_gb, cores=cores)
    fleet.node("b", memory_gb=nodes_memory_gb, cores=cores)
    model = fleet.add("chat", min_replicas=2)
    settle(fleet)
    Model.objects.filter(name="chat").update(source=NEW_SOURCE, canary=CANARY)
    settle(fleet, passes=12)
    return str(model.source)


def test_a_canary_holds_the_replacement_at_one_new_replica_beside_the_old_ones(fleet: Any) -> None:
    canary_update(fleet)
    assert fresh_and_stale(fleet) == (1, 2)  # a surge replica; both old ones still serve
    assert all(r.routable for r in fleet.replicas("chat"))

    Model.objects.filter(name="chat").update(canary={**CANARY, "state": "promoted"})
    settle(fleet, passes=20)
    assert fresh_and_stale(fleet) == (2, 0)


def test_a_rolled_back_canary_leaves_and_the_old_replicas_stay(fleet: Any) -> None:
    old_source = canary_update(fleet)
    old = {r.pk for r in fleet.replicas("chat") if r.spec["source"] == old_source}
    assert len(old) == 2
    # The rollback points the model at its old files: the canary replica is the out-of-date one.
    Model.objects.filter(name="chat").update(
        source=old_source, canary={**CANARY, "state": "rolled back"}
    )
    report = reconcile_pass()
    assert len(report.withdrawn) == 1 and not report.started
    assert {r.pk for r in fleet.replicas("chat")} == old


def test_a_plain_rollback_during_a_canary_does_not_keep_the_canary_replica(fleet: Any) -> None:
    old_source = canary_update(fleet)
    # Back to the old files while the canary record still says it runs: the replicas of the
    # current spec are not the canary's revision, so nothing is held.
    Model.objects.filter(name="chat").update(source=old_source)
    report = reconcile_pass()
    assert len(report.withdrawn) == 1
    assert fresh_and_stale(fleet) == (2, 0)


def test_without_room_for_a_surge_the_canary_replaces_one_old_replica(fleet: Any) -> None:
    canary_update(fleet, nodes_memory_gb=1, cores=1)
    assert fresh_and_stale(fleet) == (1, 1)
