""" "Fits on a node" has one home, fleet.placement.fits: the planner places by it, and the
gateway asks it before it wakes an on-demand model (fleet.selectors.unplaceable_models, through
gateway.state._unplaceable). Here the two
doors are held together: for each profile, the gateway calls the model unplaceable exactly when
the planner, given an empty fleet, finds no node for one replica of it."""

from __future__ import annotations

from typing import Any

import pytest

from catalog.models import Model
from fleet.footprint import known_facts
from fleet.models import Node
from fleet.placement import EPSILON, Resources, fits, plan_placement
from fleet.reconciler import model_demand, planner_node
from gateway.routing import read_catalog
from gateway.state import _unplaceable

pytestmark = pytest.mark.django_db


def test_a_zero_need_never_blocks_even_on_an_overcommitted_node() -> None:
    assert fits(Resources(memory_gb=2, cores=0), Resources(memory_gb=2, cores=-1))


def test_sums_of_float_reservations_do_not_flip_a_fit_on_rounding_noise() -> None:
    assert fits(Resources(memory_gb=0.1 + 0.2), Resources(memory_gb=0.3))
    assert fits(Resources(memory_gb=8 + EPSILON / 2), Resources(memory_gb=8))
    assert not fits(Resources(memory_gb=8 + 2 * EPSILON), Resources(memory_gb=8))


def test_every_resource_must_fit() -> None:
    room = Resources(memory_gb=8, cores=4, gpus=1, gpu_memory_gb=24)
    assert fits(Resources(memory_gb=8, cores=4, gpus=1, gpu_memory_gb=24), room)
    assert not fits(Resources(memory_gb=1, cores=5), room)
    assert not fits(Resources(memory_gb=1, gpus=2), room)
    assert not fits(Resources(memory_gb=1, gpus=1, gpu_memory_gb=25), room)


PROFILES = [
    pytest.param([{"name": "cpu", "memory_gb": 8, "cores": 4}], True, id="exactly-the-node"),
    # 0.1 + 0.2 GB on a node whose memory is stated as 0.3: the old gateway copy compared
    # without the planner's tolerance and refused it.
    pytest.param([{"name": "cpu", "memory_gb": 0.1 + 0.2, "cores": 1}], True, id="float-noise"),
    pytest.param([{"name": "cpu", "memory_gb": 9, "cores": 1}], False, id="too-much-memory"),
    pytest.param([{"name": "cpu", "memory_gb": 1, "cores": 5}], False, id="too-many-cores"),
    pytest.param(
        [{"name": "gpu", "memory_gb": 1, "cores": 1, "gpus": 1}, {"name": "cpu", "memory_gb": 8}],
        True,
        id="the-second-profile-fits",
    ),
    pytest.param([{"name": "gpu", "memory_gb": 1, "cores": 1, "gpus": 1}], False, id="no-gpu"),
]


@pytest.mark.parametrize(("profiles", "placed"), PROFILES)
def test_the_gateway_refuses_exactly_what_the_planner_cannot_place(
    fleet: Any, profiles: list[dict[str, Any]], placed: bool
) -> None:
    memory = 0.3 if profiles[0]["memory_gb"] == 0.1 + 0.2 else 8
    fleet.node("a", memory_gb=memory, cores=4)
    fleet.add("lazy", min_replicas=0, max_replicas=1, profiles=profiles)
    model = Model.objects.get(name="lazy")
    demand = model_demand(model, 1, known_facts([model])["lazy"])
    plan = plan_placement([planner_node(n) for n in Node.objects.all()], [demand], [])
    assert bool(plan.starts) == placed
    assert ("lazy" in _unplaceable(read_catalog())) == (not placed)
