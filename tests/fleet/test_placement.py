"""Tests for fleet.placement: one test per placement rule, then properties over random fleets.

Pure functions over dataclasses: no Django, no database.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from fleet.placement import (
    CLASS_RANK,
    EPSILON,
    MAX_MOVES,
    ModelDemand,
    Move,
    Node,
    Plan,
    Profile,
    Replica,
    Resources,
    Start,
    Stop,
    Unplaced,
    plan_placement,
)
from tests.support.placement import apply, big_fleet, res

# --- helpers ---------------------------------------------------------------------------


def minus(room: Resources, taken: Resources) -> Resources:
    return Resources(
        room.memory_gb - taken.memory_gb,
        room.cores - taken.cores,
        room.gpus - taken.gpus,
        room.gpu_memory_gb - taken.gpu_memory_gb,
    )


def fits(need: Resources, room: Resources) -> bool:
    """What the planner counts as a fit: a zero need always fits, with a small tolerance."""
    pairs = [
        (need.memory_gb, room.memory_gb),
        (need.cores, room.cores),
        (need.gpus, room.gpus),
        (need.gpu_memory_gb, room.gpu_memory_gb),
    ]
    return all(n <= 0 or n <= r + EPSILON for n, r in pairs)


def node(
    name: str,
    memory: float = 64,
    cores: float = 16,
    gpus: int = 0,
    gpu_memory: float = 0,
    schedulable: bool = True,
) -> Node:
    return Node(name, res(memory, cores, gpus, gpu_memory), schedulable)


def cpu(memory: float, cores: float = 0, name: str = "cpu") -> Profile:
    return Profile(name, res(memory, cores))


def model(
    name: str,
    klass: str = "standard",
    minimum: int = 0,
    desired: int = 1,
    profiles: Sequence[Profile] = (),
) -> ModelDemand:
    return ModelDemand(name, klass, minimum, desired, tuple(profiles) or (cpu(8),))


def replica(id: str, model: str, node: str, memory: float = 8, profile: str = "cpu") -> Replica:
    return Replica(id, model, node, profile, res(memory))


def where(plan: Plan) -> list[tuple[str, str]]:
    return [(s.model, s.node) for s in plan.starts]


def preempted(plan: Plan) -> list[str]:
    return [s.replica_id for s in plan.preemptions]


# --- count -----------------------------------------------------------------------------


def test_it_starts_missing_replicas() -> None:
    plan = plan_placement(
        [node("a"), node("b")], [model("m", desired=3)], [replica("r1", "m", "a")]
    )
    assert len(plan.starts) == 2
    assert plan.stops == plan.preemptions == plan.unplaced == ()


def test_it_scales_down_replicas_beyond_desired() -> None:
    replicas = [replica(f"r{i}", "m", n) for i, n in enumerate("abc")]
    plan = plan_placement([node("a"), node("b"), node("c")], [model("m", desired=1)], replicas)
    assert len(plan.stops) == 2
    assert {s.reason for s in plan.stops} == {"scaled down to 1"}
    assert plan.starts == ()


def test_scale_down_stops_on_the_node_with_most_replicas_of_the_model_first() -> None:
    replicas = [replica("r1", "m", "a"), replica("r2", "m", "a"), replica("r3", "m", "b")]
    # b is fuller, but a holds two replicas of m: keeping m spread matters more.
    replicas.append(replica("other", "o", "b", memory=40))
    plan = plan_placement([node("a"), node("b")], [model("m", desired=2), model("o")], replicas)
    assert [(s.replica_id, s.node) for s in plan.stops] == [("r1", "a")]


def test_scale_down_then_stops_on_the_fullest_node() -> None:
    replicas = [replica("r1", "m", "a"), replica("r2", "m", "b"), replica("x", "o", "b", 40)]
    plan = plan_placement([node("a"), node("b")], [model("m", desired=1), model("o")], replicas)
    assert [s.replica_id for s in plan.stops] == ["r2"]


def test_scale_down_drains_cordoned_nodes_first() -> None:
    replicas = [replica("r1", "m", "a"), replica("r2", "m", "b", memory=1)]
    nodes = [node("a", memory=16), node("b", schedulable=False)]
    plan = plan_placement(nodes, [model("m", desired=1)], replicas)
    assert [s.replica_id for s in plan.stops] == ["r2"]


def test_an_on_demand_model_without_demand_keeps_nothing() -> None:
    plan = plan_placement([node("a")], [model("m", minimum=0, desired=0)], [replica("r", "m", "a")])
    assert plan.stops == (Stop("r", "m", "a", "scaled down to 0"),)
    assert plan.unplaced == ()


def test_it_stops_replicas_of_models_removed_from_the_catalog() -> None:
    plan = plan_placement([node("a")], [model("kept", desired=0)], [replica("r", "gone", "a")])
    assert plan.stops == (Stop("r", "gone", "a", "model removed from the catalog"),)


def test_it_stops_replicas_on_nodes_it_does_not_know() -> None:
    plan = plan_placement([node("a")], [model("m")], [replica("r", "m", "ghost")])
    assert plan.stops == (Stop("r", "m", "ghost", "node ghost is not in the fleet"),)
    assert where(plan) == [("m", "a")]  # and it no longer counts as running


# --- placement -------------------------------------------------------------------------


def test_it_tries_profiles_in_order() -> None:
    gpu = Profile("gpu", res(8, gpus=1, gpu_memory=16))
    m = model("m", desired=1, profiles=[gpu, cpu(16)])
    with_gpu = plan_placement([node("c"), node("g", gpus=1, gpu_memory=24)], [m], [])
    assert [(s.profile, s.node) for s in with_gpu.starts] == [("gpu", "g")]
    without_gpu = plan_placement([node("c")], [m], [])
    assert [(s.profile, s.node) for s in without_gpu.starts] == [("cpu", "c")]


def test_the_first_profile_that_fits_anywhere_wins_over_spread() -> None:
    # "big" only fits on a, where m already runs; "small" would fit on the empty b.
    m = model("m", desired=2, profiles=[cpu(32, name="big"), cpu(8, name="small")])
    plan = plan_placement(
        [node("a", memory=64), node("b", memory=16)], [m], [replica("r", "m", "a", 32, "big")]
    )
    assert [(s.profile, s.node) for s in plan.starts] == [("big", "a")]


def test_it_prefers_spreading_replicas_of_one_model() -> None:
    # b is the better fit, but it already runs m.
    nodes = [node("a", memory=64), node("b", memory=32)]
    plan = plan_placement(nodes, [model("m", desired=2)], [replica("r", "m", "b")])
    assert where(plan) == [("m", "a")]
    fresh = plan_placement(nodes, [model("m", desired=2)], [])
    assert sorted(where(fresh)) == [("m", "a"), ("m", "b")]


def test_it_picks_the_best_fit_node() -> None:
    nodes = [node("a", memory=64), node("b", memory=16), node("c", memory=32), node("d", 8)]
    plan = plan_placement(nodes, [model("m", profiles=[cpu(12)])], [])
    assert where(plan) == [("m", "b")]


def test_best_fit_ties_break_on_fewer_free_cores_then_node_name() -> None:
    nodes = [node("a", memory=16, cores=8), node("b", memory=16, cores=4)]
    assert where(plan_placement(nodes, [model("m")], [])) == [("m", "b")]
    twins = [node("d", memory=16), node("c", memory=16)]
    assert where(plan_placement(twins, [model("m")], [])) == [("m", "c")]


def test_it_skips_cordoned_and_lost_nodes() -> None:
    nodes = [node("cordoned", memory=512, schedulable=False), node("ok", memory=16)]
    assert where(plan_placement(nodes, [model("m")], [])) == [("m", "ok")]
    plan = plan_placement([node("lost", schedulable=False)], [model("m")], [])
    assert plan.starts == ()
    assert plan.unplaced == (Unplaced("m", 1, "no schedulable nodes"),)


def test_every_resource_must_fit() -> None:
    gpu = Profile("gpu", res(8, cores=2, gpus=1, gpu_memory=20))
    nodes = [
        node("no-gpu", memory=256),
        node("small-gpu", gpus=1, gpu_memory=16),
        node("no-cores", cores=1, gpus=1, gpu_memory=24),
        node("ok", memory=32, cores=4, gpus=2, gpu_memory=48),
    ]
    plan = plan_placement(nodes, [model("m", profiles=[gpu])], [])
    assert where(plan) == [("m", "ok")]


def test_zero_cores_reserves_none() -> None:
    nodes = [node("a", memory=16, cores=0)]
    assert where(plan_placement(nodes, [model("m", profiles=[cpu(8, cores=0)])], [])) == [
        ("m", "a")
    ]
    assert plan_placement(nodes, [model("m", profiles=[cpu(8, cores=1)])], []).starts == ()


def test_free_counts_replicas_planned_in_the_same_pass() -> None:
    models = [model("a", profiles=[cpu(10)]), model("b", profiles=[cpu(10)])]
    plan = plan_placement([node("n", memory=16)], models, [])
    assert where(plan) == [("a", "n")]
    assert [u.model for u in plan.unplaced] == ["b"]


def test_free_excludes_replicas_stopped_in_the_same_pass() -> None:
    replicas = [replica("old", "gone", "n", 8), replica("extra", "shrinks", "n", 8)]
    models = [model("shrinks", desired=0), model("new", profiles=[cpu(16)])]
    plan = plan_placement([node("n", memory=16)], models, replicas)
    assert where(plan) == [("new", "n")]


def test_running_replicas_stay_where_they_are() -> None:
    # r sits on the worst-fit node; the planner does not move it.
    nodes = [node("big", memory=512), node("snug", memory=8)]
    plan = plan_placement(nodes, [model("m")], [replica("r", "m", "big")])
    assert plan == Plan((), (), (), ())


# --- classes and preemption ------------------------------------------------------------


def test_models_are_served_by_class_then_minimum_then_name() -> None:
    models = [
        model("o", "opportunistic", minimum=0, desired=1),
        model("s", "standard", minimum=1, desired=1),
        model("c2", "critical", minimum=0, desired=1),
        model("c1", "critical", minimum=1, desired=2),
        model("s0", "standard", minimum=0, desired=1),
        model("a", "standard", minimum=0, desired=1),
    ]
    plan = plan_placement([node("n", memory=1024)], models, [])
    assert [s.model for s in plan.starts] == ["c1", "c1", "c2", "s", "a", "s0", "o"]


def test_minimum_replicas_are_served_before_growth_of_the_same_class() -> None:
    # Room for one: "b" needs it for its minimum, "a" only to grow.
    models = [model("a", minimum=0, desired=1), model("b", minimum=1, desired=1)]
    plan = plan_placement([node("n", memory=8)], models, [])
    assert where(plan) == [("b", "n")]
    assert plan.preemptions == ()


def test_standard_gives_way_to_critical() -> None:
    models = [model("s", "standard", 1, 1, [cpu(12)]), model("c", "critical", 1, 1, [cpu(12)])]
    plan = plan_placement([node("a", memory=16)], models, [replica("rs", "s", "a", 12)])
    assert plan.preemptions == (
        Stop("rs", "s", "a", "preempted for critical model c (needs 12 GB memory on a)"),
    )
    assert where(plan) == [("c", "a")]
    assert [(u.model, u.count) for u in plan.unplaced] == [("s", 1)]


def test_opportunistic_gives_way_to_standard() -> None:
    models = [model("o", "opportunistic", 1, 1, [cpu(12)]), model("s", "standard", 1, 1, [cpu(12)])]
    plan = plan_placement([node("a", memory=16)], models, [replica("ro", "o", "a", 12)])
    assert preempted(plan) == ["ro"]
    assert where(plan) == [("s", "a")]


def test_opportunistic_gives_way_to_critical() -> None:
    models = [model("o", "opportunistic", 1, 1, [cpu(12)]), model("c", "critical", 0, 1, [cpu(12)])]
    plan = plan_placement([node("a", memory=16)], models, [replica("ro", "o", "a", 12)])
    assert preempted(plan) == ["ro"]


def test_a_lower_class_never_preempts_a_higher_one() -> None:
    models = [model("c", "critical", 0, 1, [cpu(12)]), model("s", "standard", 1, 1, [cpu(12)])]
    plan = plan_placement([node("a", memory=16)], models, [replica("rc", "c", "a", 12)])
    assert plan.preemptions == ()
    assert [u.model for u in plan.unplaced] == ["s"]


def test_critical_minimum_is_never_preempted() -> None:
    models = [model("c1", "critical", 1, 1, [cpu(12)]), model("c2", "critical", 1, 1, [cpu(12)])]
    plan = plan_placement([node("a", memory=16)], models, [replica("r1", "c1", "a", 12)])
    assert plan.preemptions == ()
    assert [u.model for u in plan.unplaced] == ["c2"]


def test_same_class_below_minimum_takes_growth_beyond_minimum() -> None:
    models = [model("x", minimum=1, desired=2, profiles=[cpu(16)]), model("y", minimum=1)]
    replicas = [replica("x1", "x", "a", 16), replica("x2", "x", "a", 16)]
    plan = plan_placement([node("a", memory=32)], models, replicas)
    assert len(plan.preemptions) == 1
    assert plan.preemptions[0].model == "x"
    assert where(plan) == [("y", "a")]
    # x lost the replica beyond its minimum and has nowhere else to go.
    assert [(u.model, u.count) for u in plan.unplaced] == [("x", 1)]


def test_same_class_never_takes_anothers_minimum() -> None:
    models = [model("x", minimum=2, desired=2, profiles=[cpu(16)]), model("y", minimum=1)]
    replicas = [replica("x1", "x", "a", 16), replica("x2", "x", "a", 16)]
    plan = plan_placement([node("a", memory=32)], models, replicas)
    assert plan.preemptions == ()
    assert [u.model for u in plan.unplaced] == ["y"]


def test_growth_above_minimum_never_preempts_the_same_class() -> None:
    models = [model("x", minimum=0, desired=1, profiles=[cpu(16)]), model("y", minimum=0)]
    plan = plan_placement([node("a", memory=16)], models, [replica("x1", "x", "a", 16)])
    assert plan.preemptions == ()
    assert [u.model for u in plan.unplaced] == ["y"]


def test_growth_above_minimum_may_preempt_a_lower_class() -> None:
    models = [model("o", "opportunistic", 1, 1, [cpu(16)]), model("s", "standard", 0, 1)]
    plan = plan_placement([node("a", memory=16)], models, [replica("ro", "o", "a", 16)])
    assert preempted(plan) == ["ro"]


def test_preemption_takes_the_lowest_class_first() -> None:
    models = [
        model("o", "opportunistic", 0, 1, [cpu(16)]),
        model("s", "standard", 0, 1, [cpu(16)]),
        model("c", "critical", 1, 1, [cpu(16)]),
    ]
    replicas = [replica("ro", "o", "a", 16), replica("rs", "s", "a", 16)]
    plan = plan_placement([node("a", memory=32)], models, replicas)
    assert preempted(plan) == ["ro"]


def test_preemption_takes_replicas_beyond_their_models_minimum_first() -> None:
    models = [
        model("o1", "opportunistic", 1, 1, [cpu(16)]),
        model("o2", "opportunistic", 0, 1, [cpu(16)]),
        model("c", "critical", 1, 1, [cpu(16)]),
    ]
    replicas = [replica("r1", "o1", "a", 16), replica("r2", "o2", "a", 16)]
    plan = plan_placement([node("a", memory=32)], models, replicas)
    assert preempted(plan) == ["r2"]


def test_preemption_takes_the_biggest_reservation_first() -> None:
    models = [model(f"o{i}", "opportunistic", 0, 1, [cpu(m)]) for i, m in enumerate([8, 8, 16])]
    models.append(model("c", "critical", 1, 1, [cpu(16)]))
    replicas = [replica(f"r{i}", f"o{i}", "a", m) for i, m in enumerate([8, 8, 16])]
    plan = plan_placement([node("a", memory=32)], models, replicas)
    assert preempted(plan) == ["r2"]


def test_victims_that_turn_out_unneeded_are_given_back() -> None:
    # The opportunistic replica goes first in victim order, but once the standard one is
    # stopped there is room without it.
    models = [
        model("o", "opportunistic", 0, 1, [cpu(4)]),
        model("s", "standard", 0, 1, [cpu(16)]),
        model("c", "critical", 1, 1, [cpu(16)]),
    ]
    replicas = [replica("ro", "o", "a", 4), replica("rs", "s", "a", 16)]
    plan = plan_placement([node("a", memory=20)], models, replicas)
    assert preempted(plan) == ["rs"]


def test_preemption_picks_the_node_with_the_cheapest_victims() -> None:
    models = [model(f"o{i}", "opportunistic", 0, 1, [cpu(8)]) for i in range(2)]
    models += [
        model("big", "opportunistic", 0, 1, [cpu(16)]),
        model("kept", "opportunistic", 1, 1, [cpu(16)]),
        model("s", "standard", 0, 1, [cpu(16)]),
        model("c", "critical", 1, 1, [cpu(16)]),
    ]
    two = [replica("r0", "o0", "two", 8), replica("r1", "o1", "two", 8)]
    one = [replica("rb", "big", "one", 16)]
    standard = [replica("rs", "s", "std", 16)]
    minimum = [replica("rk", "kept", "min", 16)]

    def victims(*fleet: list[Replica]) -> list[str]:
        replicas = [r for part in fleet for r in part]
        nodes = [node(n, memory=16) for n in sorted({r.node for r in replicas})]
        # Only the models in this fleet, so nothing else competes for the room freed.
        present = {r.model for r in replicas} | {"c"}
        demands = [m for m in models if m.name in present]
        return sorted(preempted(plan_placement(nodes, demands, replicas)))

    # The lowest class wins over fewer victims: two opportunistic rather than one standard.
    assert victims(two, standard) == ["r0", "r1"]
    # Then fewest victims.
    assert victims(two, one) == ["rb"]
    # Then victims beyond their model's minimum rather than within it.
    assert victims(minimum, one) == ["rb"]


def test_it_never_preempts_when_all_allowed_victims_would_not_make_room() -> None:
    models = [model("o", "opportunistic", 0, 1, [cpu(8)]), model("c1", "critical", 1, 1, [cpu(16)])]
    models.append(model("c2", "critical", 1, 1, [cpu(24)]))
    replicas = [replica("ro", "o", "a", 8), replica("rc", "c1", "a", 16)]
    plan = plan_placement([node("a", memory=32)], models, replicas)
    assert plan.preemptions == ()
    assert [u.model for u in plan.unplaced] == ["c2"]


def test_a_preempted_replica_is_not_counted_as_running() -> None:
    # c only fits on a; s moves to b, where it fits but c does not.
    models = [model("s", "standard", 1, 1, [cpu(12)]), model("c", "critical", 1, 1, [cpu(16)])]
    nodes = [node("a", memory=16), node("b", memory=12)]
    plan = plan_placement(nodes, models, [replica("rs", "s", "a", 12)])
    assert preempted(plan) == ["rs"]
    assert where(plan) == [("c", "a"), ("s", "b")]
    assert plan.unplaced == ()


def test_every_profile_is_tried_without_preemption_first() -> None:
    models = [
        model("o", "opportunistic", 1, 1, [cpu(16)]),
        model("c", "critical", 1, 1, [cpu(16, name="big"), cpu(8, name="small")]),
    ]
    nodes = [node("a", memory=16), node("b", memory=8)]
    plan = plan_placement(nodes, models, [replica("ro", "o", "a", 16)])
    assert plan.preemptions == ()
    assert [(s.profile, s.node) for s in plan.starts] == [("small", "b")]


# --- unplaced --------------------------------------------------------------------------


def test_unplaced_reason_names_the_short_resource_and_the_best_node() -> None:
    gpu = Profile("gpu", res(24))
    nodes = [node("a", memory=8), node("b", memory=12), node("c", memory=64, schedulable=False)]
    plan = plan_placement(nodes, [model("m", desired=2, profiles=[gpu, cpu(32)])], [])
    assert plan.unplaced == (
        Unplaced(
            "m", 2, "no node has 24 GB memory free for profile gpu; the largest free is 12 GB on b"
        ),
    )


def test_unplaced_reason_for_gpus() -> None:
    gpu = Profile("gpu", res(8, gpus=2, gpu_memory=16))
    nodes = [node("a", gpus=1, gpu_memory=80), node("b")]
    plan = plan_placement(nodes, [model("m", profiles=[gpu])], [])
    assert plan.unplaced[0].reason == (
        "needs 2 GPUs for profile gpu; the most free on any node is 1 (a)"
    )


def test_unplaced_reason_when_each_resource_is_free_only_on_different_nodes() -> None:
    nodes = [node("a", memory=32, cores=2), node("b", memory=8, cores=16)]
    plan = plan_placement(nodes, [model("m", profiles=[cpu(16, cores=8)])], [])
    assert plan.unplaced[0].reason == (
        "no single node has 16 GB memory, 8 cores free for profile cpu; "
        "the closest is a, short on cores (2 free of 8)"
    )


def test_unplaced_counts_every_missing_replica() -> None:
    plan = plan_placement([node("a", memory=8)], [model("m", desired=3)], [])
    assert [(u.model, u.count) for u in plan.unplaced] == [("m", 2)]


def test_a_model_without_profiles_is_unplaced() -> None:
    m = ModelDemand("m", "standard", 1, 1, ())
    assert plan_placement([node("a")], [m], []).unplaced == (
        Unplaced("m", 1, "the model has no profiles"),
    )


# --- API details -----------------------------------------------------------------------


def test_a_zero_need_and_float_noise_never_block_a_fit() -> None:
    # Zero cores need no cores, even on a node that is short of them.
    plan = plan_placement([node("a", memory=8, cores=0)], [model("m", profiles=[cpu(8, 0)])], [])
    assert [s.node for s in plan.starts] == ["a"]
    # 0.1 + 0.2 GB fits in 0.3 GB.
    noisy = Profile("p", res(0.1 + 0.2))
    plan = plan_placement([node("a", memory=0.3)], [model("m", profiles=[noisy])], [])
    assert [s.node for s in plan.starts] == ["a"]


@pytest.mark.parametrize(
    ("nodes", "models", "replicas"),
    [
        ([node("a"), node("a")], [], []),
        ([], [model("m"), model("m")], []),
        ([], [model("m", klass="vip")], []),
        ([], [model("m", minimum=-1)], []),
        ([], [model("m", profiles=[cpu(-1)])], []),
        ([node("a")], [model("m")], [replica("r", "m", "a"), replica("r", "m", "a")]),
    ],
)
def test_it_rejects_invalid_input(
    nodes: list[Node], models: list[ModelDemand], replicas: list[Replica]
) -> None:
    with pytest.raises(ValueError):
        plan_placement(nodes, models, replicas)


def test_the_plan_does_not_depend_on_input_order() -> None:
    nodes, models, replicas = big_fleet(seed=1, n_models=300, n_nodes=40)
    plan = plan_placement(nodes, models, replicas)
    rng = random.Random(2)
    for _ in range(3):
        assert plan_placement(*_shuffled((nodes, models, replicas), rng)) == plan


def _shuffled(fleet: Fleet, rng: random.Random) -> Fleet:
    nodes, models, replicas = list(fleet[0]), list(fleet[1]), list(fleet[2])
    rng.shuffle(nodes)
    rng.shuffle(models)
    rng.shuffle(replicas)
    return nodes, models, replicas


# --- properties ------------------------------------------------------------------------

SHAPES = [
    res(0),
    res(4, 1),
    res(8),
    res(8, 2),
    res(16, 4),
    res(24, 0, 1, 24),
    res(8, 2, 1, 16),
    res(4, 0, 2, 48),
]


Fleet = tuple[list[Node], list[ModelDemand], list[Replica]]


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    """Random valid inputs: every existing replica fits its node."""
    nodes = [
        Node(
            f"n{i}",
            res(
                draw(st.sampled_from([0, 8, 16, 24, 32, 48])),
                draw(st.sampled_from([0, 2, 4, 8])),
                draw(st.integers(0, 2)),
                draw(st.sampled_from([0, 24, 48])),
            ),
            draw(st.sampled_from([True, True, True, False])),
        )
        for i in range(draw(st.integers(0, 5)))
    ]
    models = []
    for i in range(draw(st.integers(0, 7))):
        desired = draw(st.integers(0, 3))
        shapes = draw(st.lists(st.sampled_from(range(len(SHAPES))), max_size=2, unique=True))
        models.append(
            ModelDemand(
                f"m{i}",
                draw(st.sampled_from(sorted(CLASS_RANK))),
                draw(st.integers(0, desired)),
                desired,
                tuple(Profile(f"p{s}", SHAPES[s]) for s in shapes),
            )
        )
    replicas: list[Replica] = []
    if nodes:
        free = {n.name: n.capacity for n in nodes}
        owners = [m.name for m in models] + ["removed"]
        for i in range(draw(st.integers(0, 12))):
            owner = draw(st.sampled_from(owners))
            shape = draw(st.sampled_from(SHAPES))
            on = draw(st.sampled_from(nodes)).name
            if fits(shape, free[on]):
                free[on] = minus(free[on], shape)
                replicas.append(Replica(f"r{i}", owner, on, "p", shape))
    return nodes, models, replicas


PROPERTY_SETTINGS = hypothesis_settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY_SETTINGS
@given(fleets())
def test_the_plan_never_overcommits_a_node(fleet: Fleet) -> None:
    nodes, models, replicas = fleet
    after = apply(plan_placement(nodes, models, replicas), replicas)
    free = {n.name: n.capacity for n in nodes}
    for replica in after:
        if replica.node in free:
            free[replica.node] = minus(free[replica.node], replica.resources)
    for name, room in free.items():
        assert min(room.memory_gb, room.cores, room.gpus, room.gpu_memory_gb) >= -EPSILON, name


@PROPERTY_SETTINGS
@given(fleets())
def test_critical_replicas_within_their_minimum_are_never_preempted(fleet: Fleet) -> None:
    nodes, models, replicas = fleet
    plan = plan_placement(nodes, models, replicas)
    known = {n.name for n in nodes}
    running = Counter(r.model for r in replicas if r.node in known)
    lost = Counter(s.model for s in plan.preemptions)
    for m in models:
        if m.klass == "critical":
            kept = min(running[m.name], m.desired)  # what scale down leaves
            assert lost[m.name] <= max(0, kept - m.minimum) + _started(plan, m.name), m.name
            after = Counter(r.model for r in apply(plan, replicas))
            assert after[m.name] >= min(kept, m.minimum), m.name


def _started(plan: Plan, model: str) -> int:
    return sum(s.model == model for s in plan.starts)


@PROPERTY_SETTINGS
@given(fleets())
def test_nothing_starts_on_an_unschedulable_node(fleet: Fleet) -> None:
    nodes, models, replicas = fleet
    schedulable = {n.name for n in nodes if n.schedulable}
    for start in plan_placement(nodes, models, replicas).starts:
        assert start.node in schedulable


@PROPERTY_SETTINGS
@given(fleets())
def test_no_model_ends_above_desired_and_unplaced_accounts_for_the_rest(fleet: Fleet) -> None:
    nodes, models, replicas = fleet
    plan = plan_placement(nodes, models, replicas)
    after = Counter(r.model for r in apply(plan, replicas))
    short = {u.model: u.count for u in plan.unplaced}
    for m in models:
        assert after[m.name] <= m.desired
        assert after[m.name] + short.get(m.name, 0) == m.desired
    assert after["removed"] == 0
    for start in plan.starts:  # starts use one of the model's own profiles
        profiles = {
            p.name: p.resources for p in next(m for m in models if m.name == start.model).profiles
        }
        assert profiles[start.profile] == start.resources


@PROPERTY_SETTINGS
@given(fleets(), st.randoms(use_true_random=False))
def test_the_same_input_gives_the_same_plan(fleet: Fleet, rng: random.Random) -> None:
    nodes, models, replicas = fleet
    plan = plan_placement(nodes, models, replicas)
    assert plan_placement(nodes, models, replicas) == plan
    assert plan_placement(*_shuffled(fleet, rng)) == plan


@PROPERTY_SETTINGS
@given(fleets())
def test_planning_again_after_applying_the_plan_changes_nothing(fleet: Fleet) -> None:
    nodes, models, replicas = fleet
    plan = plan_placement(nodes, models, replicas)
    again = plan_placement(nodes, models, apply(plan, replicas))
    assert again.starts == again.stops == again.preemptions == ()
    assert again.unplaced == plan.unplaced


# --- scale -----------------------------------------------------------------------------


def test_start_and_stop_are_plain_values() -> None:
    # The reconciler stores and compares these; they must be hashable values.
    assert len({Start("m", "a", "cpu", res(8)), Start("m", "a", "cpu", res(8))}) == 1


def test_the_index_built_in_one_sort_is_the_one_built_update_by_update() -> None:
    """The planner's first steps defer the index of free room and sort it once; it must be
    the same index as one updated node by node, and nothing may look a node up meanwhile."""
    from fleet import placement

    nodes, models, replicas = big_fleet(seed=3, n_models=40, n_nodes=60, memory_scale=0.5)
    planner = placement._Planner(nodes, models)
    planner.adopt(replicas)
    by_update = placement._FreeIndex()
    for state in planner.nodes.values():
        by_update.update(state)
    assert planner.index._buckets == by_update._buckets
    assert planner.index._where == by_update._where
    assert any(len(bucket) > 1 for bucket in by_update._buckets.values())
    with planner.index.deferred(), pytest.raises(AssertionError, match="deferred"):
        planner.index.best_fit((1.0, 1.0, 0.0, 0.0), planner.nodes, {})


# --- moves (rule 6) ----------------------------------------------------------------------


def test_a_model_bunched_on_one_node_moves_a_replica_to_a_node_with_room() -> None:
    nodes = [node("a"), node("b")]
    replicas = [replica("r1", "m", "a"), replica("r2", "m", "a")]
    plan = plan_placement(nodes, [model("m", desired=2)], replicas)
    assert plan.moves == (Move("r1", "m", "a", "b", 2),)
    assert plan.starts == plan.stops == ()  # the reconciler starts its replacement next


def test_nothing_moves_where_no_node_without_the_model_has_free_room() -> None:
    replicas = [replica("r1", "m", "a"), replica("r2", "m", "a"), replica("o", "o", "b", 60)]
    full = plan_placement([node("a"), node("b")], [model("m", desired=2), model("o")], replicas)
    assert full.moves == ()
    cordoned = plan_placement(
        [node("a"), node("b", schedulable=False)], [model("m", desired=2)], replicas[:2]
    )
    assert cordoned.moves == ()
    # Three replicas over two nodes: as spread as they can be.
    three = [*replicas[:2], replica("r3", "m", "b")]
    assert plan_placement([node("a"), node("b")], [model("m", desired=3)], three).moves == ()


def test_nothing_moves_for_a_model_this_pass_changes_or_that_is_being_replaced() -> None:
    nodes = [node("a"), node("b"), node("c")]
    replicas = [replica("r1", "m", "a"), replica("r2", "m", "a")]
    growing = plan_placement(nodes, [model("m", desired=3)], replicas)
    assert growing.moves == () and where(growing) == [("m", "b")]
    leaving = [replicas[0], Replica("r2", "m", "a", "cpu", res(8), leaving=True)]
    assert plan_placement(nodes, [model("m", desired=2)], leaving).moves == ()


def test_replicas_on_their_way_out_do_not_count_in_the_spread() -> None:
    # a is the better fit and both nodes hold one replica; b's is being replaced, so the
    # replacement goes to b, where the model will otherwise be gone.
    nodes = [node("a", memory=32), node("b", memory=64)]
    replicas = [replica("r1", "m", "a"), Replica("r2", "m", "b", "cpu", res(8), leaving=True)]
    plan = plan_placement(nodes, [model("m", desired=3)], replicas)
    assert where(plan) == [("m", "b")]
    counted = plan_placement(nodes, [model("m", desired=3)], [replicas[0], replica("r2", "m", "b")])
    assert where(counted) == [("m", "a")]  # the same fleet, nothing leaving: best fit


def test_a_pass_moves_at_most_one_replica_per_model_and_max_moves_in_all() -> None:
    names = [f"m{i:02}" for i in range(MAX_MOVES + 3)]
    nodes = [node("a", memory=1024), *(node(f"n{i}") for i in range(3))]
    replicas = [replica(f"{m}-{i}", m, "a") for m in names for i in range(3)]
    plan = plan_placement(nodes, [model(m, desired=3) for m in names], replicas)
    assert len(plan.moves) == MAX_MOVES
    assert len({move.model for move in plan.moves}) == MAX_MOVES


def test_the_replacement_of_a_moving_replica_preempts_nothing() -> None:
    nodes = [node("a", memory=16), node("b", memory=16)]
    replicas = [
        replica("r1", "m", "a"),
        Replica("r2", "m", "a", "cpu", res(8), leaving=True),
        replica("low", "o", "b", 16),
    ]
    models = [model("m", minimum=2, desired=3), model("o", klass="opportunistic")]
    updating = plan_placement(nodes, models, replicas)
    assert preempted(updating) == ["low"] and ("m", "b") in where(updating)
    moving = [replace(models[0], moving=True), models[1]]
    plan = plan_placement(nodes, moving, replicas)
    assert plan.preemptions == () and plan.starts == ()
    assert [u.model for u in plan.unplaced] == ["m"]
