"""Tests for fleet.placement's GPU rule (rule 7): devices, their memory, other programs' use, and
nodes whose engine has no GPU backend. Pure: no Django, no database."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.placement import (
    EPSILON,
    Device,
    DeviceRoom,
    ModelDemand,
    Node,
    Profile,
    Replica,
    plan_placement,
)
from tests.fleet.test_placement import PROPERTY_SETTINGS
from tests.support.placement import apply, res


def gpu_node(
    name: str, *devices: Device, memory: float = 64, cores: float = 16, engine: bool = True
) -> Node:
    return Node(name, res(memory, cores), devices=tuple(devices), gpu_engine=engine)


def gpu_profile(gpus: int = 1, gpu_memory: float = 8, memory: float = 4, name: str = "gpu"):
    """``gpu_memory`` is the replica's total over its GPUs, as the planner reserves it."""
    return Profile(name, res(memory, 0, gpus, gpu_memory))


def model(name: str, *profiles: Profile, klass: str = "standard", minimum: int = 0, desired=1):
    return ModelDemand(name, klass, minimum, desired, tuple(profiles) or (gpu_profile(),))


def test_it_fits_on_one_device() -> None:
    plan = plan_placement([gpu_node("g", Device(0, 24))], [model("m")], [])
    assert [(s.node, s.devices, s.gb_per_device) for s in plan.starts] == [("g", (0,), 8)]


def test_it_does_not_fit_where_another_program_holds_the_memory() -> None:
    # 24 GB, nothing reserved by llmgw, 20 GB observed in use: another program's.
    plan = plan_placement([gpu_node("g", Device(0, 24, used_gb=20))], [model("m")], [])
    assert plan.starts == ()
    (unplaced,) = plan.unplaced
    assert unplaced.reason == (
        "no node has 1 GPU with 8 GB of GPU memory free for profile gpu; the closest is g "
        "(GPU 0: 24 GB, 0 GB reserved by llmgw, 20 GB used by other programs, 4 GB free)"
    )
    assert unplaced.devices == (DeviceRoom("g", 0, 24, 0, 20, 4, 8),)


def test_what_llmgw_reserved_is_not_counted_twice_when_it_is_observed() -> None:
    # A running replica reserves 16 GB and its engine is seen using 16: 8 GB are free.
    running = Replica("r", "other", "g", "gpu", res(4, 0, 1, 16), devices=(0,))
    nodes = [gpu_node("g", Device(0, 24, used_gb=16))]
    models = [model("m"), model("other", gpu_profile(gpu_memory=16))]
    plan = plan_placement(nodes, models, [running])
    assert [(s.model, s.devices) for s in plan.starts] == [("m", (0,))]
    # Observed 18 (2 GB of another program): the 8 GB no longer fit.
    nodes = [gpu_node("g", Device(0, 24, used_gb=18))]
    assert plan_placement(nodes, models, [running]).starts == ()


def test_it_splits_a_replica_over_two_devices() -> None:
    nodes = [gpu_node("g", Device(0, 16), Device(1, 16), Device(2, 16, used_gb=12))]
    plan = plan_placement(nodes, [model("m", gpu_profile(gpus=2, gpu_memory=20))], [])
    assert [(s.devices, s.gb_per_device) for s in plan.starts] == [((0, 1), 10)]


def test_a_split_needs_that_many_distinct_devices_with_room() -> None:
    # 30 GB over 2 devices: 15 each. One device has 40 free, the other 10: no.
    nodes = [gpu_node("g", Device(0, 40), Device(1, 24, used_gb=14))]
    plan = plan_placement(nodes, [model("m", gpu_profile(gpus=2, gpu_memory=30))], [])
    assert plan.starts == ()
    assert plan.unplaced[0].reason.startswith(
        "no node has 2 GPUs with 15 GB of GPU memory free each for profile gpu; the closest is g"
    )


def test_it_prefers_the_emptiest_device() -> None:
    nodes = [gpu_node("g", Device(0, 24, used_gb=10), Device(1, 24, used_gb=2), Device(2, 24, 6))]
    plan = plan_placement(nodes, [model("m")], [])
    assert [s.devices for s in plan.starts] == [(1,)]


def test_devices_are_shared_by_memory_and_replicas_in_the_pass_count() -> None:
    # Three 8 GB replicas on two 16 GB devices: emptiest first, so 0, 1, then 0 again.
    nodes = [gpu_node("g", Device(0, 16), Device(1, 16))]
    plan = plan_placement(nodes, [model("m", desired=3)], [])
    assert [s.devices for s in plan.starts] == [(0,), (1,), (0,)]
    assert plan_placement(nodes, [model("m", desired=5)], []).unplaced[0].count == 1


def test_a_gpu_profile_is_refused_on_a_node_without_a_gpu_engine() -> None:
    nodes = [gpu_node("cpu-only", Device(0, 80), engine=False)]
    plan = plan_placement(nodes, [model("m")], [])
    assert plan.starts == ()
    assert plan.unplaced[0].reason.startswith(
        "no node has a GPU engine (an engine built with CUDA): profile gpu needs 1 GPU, and "
        "the engine of every schedulable node (cpu-only) has only its CPU backend. On a machine "
        "with NVIDIA GPUs, build the engine with `LLMGW_ENGINE=cuda make setup`"
    )


def test_a_node_without_a_gpu_engine_still_takes_the_cpu_profile() -> None:
    nodes = [gpu_node("cpu-only", Device(0, 80), engine=False)]
    m = model("m", gpu_profile(), Profile("cpu", res(8)))
    assert [(s.profile, s.devices) for s in plan_placement(nodes, [m], []).starts] == [("cpu", ())]


def test_node_choice_is_among_nodes_where_the_devices_fit() -> None:
    # a is the best fit for host memory, but its only device is held by another program.
    nodes = [
        gpu_node("a", Device(0, 24, used_gb=23), memory=8),
        gpu_node("b", Device(0, 24), memory=64),
    ]
    assert [s.node for s in plan_placement(nodes, [model("m")], []).starts] == ["b"]


def test_preemption_frees_a_device() -> None:
    # The opportunistic replica holds 16 of device 0's 24 GB; the critical model needs 16.
    victim = Replica("v", "low", "g", "gpu", res(4, 0, 1, 16), devices=(0,))
    nodes = [gpu_node("g", Device(0, 24, used_gb=16))]
    models = [
        model("low", gpu_profile(gpu_memory=16), klass="opportunistic"),
        model("high", gpu_profile(gpu_memory=16), klass="critical", minimum=1),
    ]
    plan = plan_placement(nodes, models, [victim])
    assert [s.replica_id for s in plan.preemptions] == ["v"]
    assert [(s.model, s.devices) for s in plan.starts] == [("high", (0,))]


def test_preemption_never_counts_on_memory_other_programs_hold() -> None:
    # Stopping the 8 GB victim leaves 24 - 14 (another program's) = 10 GB: not 16.
    victim = Replica("v", "low", "g", "gpu", res(4, 0, 1, 8), devices=(0,))
    nodes = [gpu_node("g", Device(0, 24, used_gb=22))]
    models = [
        model("low", klass="opportunistic"),
        model("high", gpu_profile(gpu_memory=16), klass="critical", minimum=1),
    ]
    plan = plan_placement(nodes, models, [victim])
    assert plan.preemptions == () and plan.starts == ()


def test_preemption_takes_a_victim_on_the_device_that_helps() -> None:
    # Two victims of one class; only the one on device 1 makes room (stopping v0 frees 8 GB
    # of device 0, where another program holds 16), though v0 is bigger and is taken first.
    victims = [
        Replica("v0", "low", "g", "gpu", res(8, 0, 1, 8), devices=(0,)),
        Replica("v1", "low", "g", "gpu", res(4, 0, 1, 10), devices=(1,)),
    ]
    nodes = [gpu_node("g", Device(0, 24, used_gb=24), Device(1, 24, used_gb=20))]
    models = [
        model("low", gpu_profile(gpu_memory=10), klass="opportunistic", desired=2),
        model("high", gpu_profile(gpu_memory=12), klass="critical", minimum=1),
    ]
    plan = plan_placement(nodes, models, victims)
    assert [s.replica_id for s in plan.preemptions] == ["v1"]
    assert [(s.model, s.devices) for s in plan.starts] == [("high", (1,))]


def test_a_running_gpu_replica_without_devices_is_accounted_on_the_emptiest() -> None:
    running = Replica("r", "other", "g", "gpu", res(4, 0, 1, 16))
    nodes = [gpu_node("g", Device(0, 24), Device(1, 24, used_gb=4))]
    models = [model("other", gpu_profile(gpu_memory=16)), model("m", gpu_profile(gpu_memory=16))]
    plan = plan_placement(nodes, models, [running])
    # r is taken to hold device 0 (the emptiest); m gets device 1's 20 free GB.
    assert [(s.model, s.devices) for s in plan.starts] == [("m", (1,))]


def test_a_node_without_a_device_list_keeps_the_aggregate_rule() -> None:
    old = Node("old", res(64, 16, 2, 48))  # 2 GPUs, 48 GB between them, no devices listed
    plan = plan_placement([old], [model("m", gpu_profile(gpus=2, gpu_memory=40))], [])
    assert [(s.node, s.devices) for s in plan.starts] == [("old", ())]


@pytest.mark.parametrize("devices", [(Device(0, 8), Device(0, 8)), (Device(-1, 8),)])
def test_it_rejects_bad_devices(devices: tuple[Device, ...]) -> None:
    with pytest.raises(ValueError):
        plan_placement([gpu_node("g", *devices)], [], [])


# --- properties ------------------------------------------------------------------------


@st.composite
def device_fleets(draw: st.DrawFn) -> tuple[list[Node], list[ModelDemand], list[Replica]]:
    nodes = []
    for i in range(draw(st.integers(1, 3))):
        devices = []
        for d in range(draw(st.integers(0, 3))):
            total = draw(st.sampled_from([8, 16, 24]))
            devices.append(Device(d, total, min(total, draw(st.sampled_from([0, 0, 4, 12])))))
        nodes.append(gpu_node(f"n{i}", *devices, memory=64, engine=draw(st.booleans())))
    models = []
    for i in range(draw(st.integers(1, 5))):
        desired = draw(st.integers(0, 3))
        gpus = draw(st.integers(1, 2))
        profile = gpu_profile(gpus=gpus, gpu_memory=gpus * draw(st.sampled_from([2, 6, 10])))
        klass = draw(st.sampled_from(["critical", "standard", "opportunistic"]))
        models.append(
            model(
                f"m{i}",
                profile,
                klass=klass,
                minimum=draw(st.integers(0, desired)),
                desired=desired,
            )
        )
    return nodes, models, []


@PROPERTY_SETTINGS
@given(device_fleets())
def test_no_device_is_overcommitted_and_a_second_pass_changes_nothing(fleet) -> None:
    nodes, models, replicas = fleet
    plan = plan_placement(nodes, models, replicas)
    after = apply(plan, replicas)
    reserved: dict[tuple[str, int], float] = {}
    for replica in after:
        for index in replica.devices:
            key = (replica.node, index)
            share = replica.resources.gpu_memory_gb / len(replica.devices)
            reserved[key] = reserved.get(key, 0.0) + share
    for node in nodes:
        for device in node.devices:
            assert reserved.get((node.name, device.index), 0.0) <= (
                device.total_gb - device.used_gb + EPSILON
            )
    for replica in after:
        engine = next(n for n in nodes if n.name == replica.node).gpu_engine
        assert engine and len(set(replica.devices)) == replica.resources.gpus
    # The next pass sees the new engines' memory in use, beside the other programs'.
    seen = [
        Node(
            n.name,
            n.capacity,
            devices=tuple(
                Device(d.index, d.total_gb, d.used_gb + reserved.get((n.name, d.index), 0.0))
                for d in n.devices
            ),
            gpu_engine=n.gpu_engine,
        )
        for n in nodes
    ]
    again = plan_placement(seen, models, after)
    assert again.starts == again.stops == again.preemptions == ()


def _seen(nodes: list[Node], replicas: list[Replica]) -> list[Node]:
    """The nodes as the next pass sees them: the replicas' engines' memory observed in use."""
    held: dict[tuple[str, int], float] = {}
    for replica in replicas:
        for index in replica.devices:
            key = (replica.node, index)
            held[key] = held.get(key, 0.0) + replica.resources.gpu_memory_gb / len(replica.devices)
    return [
        Node(
            n.name,
            n.capacity,
            devices=tuple(
                Device(
                    d.index, d.total_gb, min(d.total_gb, d.used_gb + held.get((n.name, d.index), 0))
                )
                for d in n.devices
            ),
            gpu_engine=n.gpu_engine,
        )
        for n in nodes
    ]


@PROPERTY_SETTINGS
@given(device_fleets(), st.randoms(use_true_random=False))
def test_preemption_never_overcommits_a_device_either(fleet, rng) -> None:
    nodes, models, _ = fleet
    first = apply(plan_placement(nodes, models, []), [], "first")
    # The catalog changes: more replicas wanted, classes shuffled.
    changed = [
        ModelDemand(
            m.name,
            rng.choice(["critical", "standard", "opportunistic"]),
            m.desired + 1,
            m.desired + 1,
            m.profiles,
        )
        for m in models
    ]
    after = apply(plan_placement(_seen(nodes, first), changed, first), first, "second")
    others = {(n.name, d.index): d.used_gb for n in nodes for d in n.devices}
    reserved: dict[tuple[str, int], float] = {}
    for replica in after:
        for index in replica.devices:
            key = (replica.node, index)
            share = replica.resources.gpu_memory_gb / len(replica.devices)
            reserved[key] = reserved.get(key, 0.0) + share
    for node in nodes:
        for device in node.devices:
            key = (node.name, device.index)
            assert reserved.get(key, 0.0) <= device.total_gb - others[key] + EPSILON, key
