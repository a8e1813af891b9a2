"""Fleets for the placement planner: the pure values its tests and bench/placement.py feed it."""

from __future__ import annotations

import random
from collections.abc import Sequence

from fleet.placement import (
    CLASS_RANK,
    ModelDemand,
    Node,
    Plan,
    Profile,
    Replica,
    Resources,
    plan_placement,
)


def res(memory: float = 0, cores: float = 0, gpus: int = 0, gpu_memory: float = 0) -> Resources:
    return Resources(memory_gb=memory, cores=cores, gpus=gpus, gpu_memory_gb=gpu_memory)


def apply(plan: Plan, replicas: Sequence[Replica], tag: str = "new") -> list[Replica]:
    """The replicas after the plan is carried out."""
    gone = {stop.replica_id for stop in plan.stops + plan.preemptions}
    kept = [r for r in replicas if r.id not in gone]
    started = [
        Replica(f"{tag}-{i}", s.model, s.node, s.profile, s.resources, s.devices)
        for i, s in enumerate(plan.starts)
    ]
    return kept + started


def big_fleet(
    seed: int, n_models: int = 10_000, n_nodes: int = 1_000, memory_scale: float = 1.0
) -> tuple[list[Node], list[ModelDemand], list[Replica]]:
    """A fleet like production: 30% GPU nodes, models with a GPU and/or a CPU profile."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n_nodes):
        if i % 10 < 3:
            gpus = rng.choice([4, 8])
            capacity = res(512, 96, gpus, 80 * gpus)
        else:
            capacity = res(rng.choice([128, 256, 512]) * memory_scale, rng.choice([32, 64, 96]))
        nodes.append(Node(f"node-{i:04d}", capacity, rng.random() > 0.02))
    models = []
    for i in range(n_models):
        memory = rng.choice([2, 4, 8, 16, 24, 48])
        profiles = []
        if rng.random() < 0.4:
            profiles.append(Profile("gpu", res(memory / 2, 4, rng.choice([1, 1, 2]), memory)))
        profiles.append(Profile("cpu", res(memory, rng.choice([0, 2, 4, 8]))))
        desired = rng.choice([0, 1, 1, 2, 3])
        models.append(
            ModelDemand(
                f"model-{i:05d}",
                rng.choice(sorted(CLASS_RANK)),
                rng.randint(0, desired),
                desired,
                tuple(profiles),
            )
        )
    # Start from the fleet as the planner left it, then change a third of the catalog.
    replicas = apply(plan_placement(nodes, models, []), [], "boot")
    changed = []
    for m in models:
        if rng.random() < 0.3:
            desired = rng.choice([0, 1, 2, 3, 4])
            m = ModelDemand(
                m.name, rng.choice(sorted(CLASS_RANK)), rng.randint(0, desired), desired, m.profiles
            )
        changed.append(m)
    return nodes, changed, replicas
