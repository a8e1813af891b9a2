"""The reconciler during a canary update: one replica of the new spec beside all the old ones,
until the canary is promoted (the replacement goes on) or rolled back (the canary leaves)."""

from __future__ import annotations

from typing import Any

import pytest

from catalog.models import Model
from catalog.services import model_restart
from fleet.reconciler import reconcile_pass
from fleet.specs import current_keys
from tests.fleet.test_reconciler import settle

pytestmark = pytest.mark.django_db

CANARY = {"state": "watching", "revision": "new", "percent": 10}


def fresh_and_stale(fleet: Any) -> tuple[int, int]:
    keys = current_keys(Model.objects.get(name="chat"))
    replicas = fleet.replicas("chat")
    fresh = sum(r.spec_key == keys[r.profile] for r in replicas)
    return fresh, len(replicas) - fresh


def test_a_canary_holds_the_replacement_at_one_new_replica_beside_the_old_ones(fleet: Any) -> None:
    fleet.node("a", memory_gb=8)
    fleet.node("b", memory_gb=8)
    fleet.add("chat", min_replicas=2)
    settle(fleet)
    model_restart(actor=fleet.owner, name="chat")  # every replica out of date, as an update makes
    Model.objects.filter(name="chat").update(canary=CANARY)
    settle(fleet, passes=12)
    assert fresh_and_stale(fleet) == (1, 2)  # a surge replica; both old ones still serve
    assert all(r.routable for r in fleet.replicas("chat"))

    Model.objects.filter(name="chat").update(canary={**CANARY, "state": "promoted"})
    settle(fleet, passes=20)
    assert fresh_and_stale(fleet) == (2, 0)


def test_a_rolled_back_canary_leaves_and_the_old_replicas_stay(fleet: Any) -> None:
    fleet.node("a", memory_gb=8)
    fleet.node("b", memory_gb=8)
    fleet.add("chat", min_replicas=2)
    settle(fleet)
    old = {r.pk for r in fleet.replicas("chat")}
    model_restart(actor=fleet.owner, name="chat")
    Model.objects.filter(name="chat").update(canary=CANARY)
    settle(fleet, passes=12)
    assert fresh_and_stale(fleet) == (1, 2)

    # The rollback puts the old spec back: the canary replica is now the out-of-date one.
    Model.objects.filter(name="chat").update(
        generation=0, canary={**CANARY, "state": "rolled back"}
    )
    report = reconcile_pass()
    assert len(report.withdrawn) == 1 and not report.started
    assert {r.pk for r in fleet.replicas("chat")} == old


def test_without_room_for_a_surge_the_canary_replaces_one_old_replica(fleet: Any) -> None:
    fleet.node("a", memory_gb=1, cores=1)
    fleet.node("b", memory_gb=1, cores=1)
    fleet.add("chat", min_replicas=2)
    settle(fleet)
    model_restart(actor=fleet.owner, name="chat")
    Model.objects.filter(name="chat").update(canary=CANARY)
    settle(fleet, passes=12)
    assert fresh_and_stale(fleet) == (1, 1)
