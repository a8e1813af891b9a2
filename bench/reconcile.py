"""One reconcile pass at 100, 1,000 and 10,000 models over 10, 100 and 1,000 simulated nodes:
wall time and SQL queries, for the first pass (placing everything) and a steady pass (nothing to do).

--replicas N gives each model N replicas: `--pairs 20x5000 --replicas 1000` is bench/fleet.py's
largest fleet (5,000 nodes, 4 replicas each), its steady pass measured alone, with the CPU time
of this process (the worker's share of it) beside the wall time. The quiet pass comes after the
steady one with nothing changed: on PostgreSQL it stops at the fleet's stamp (fleet.reconciler.Quiet).

Run: make bench (or .venv/bin/python bench/reconcile.py [--pairs 100x10,1000x100] [--replicas N])
"""

from __future__ import annotations

import argparse
import time

if __name__ == "__main__":
    from _django import setup  # type: ignore[import-not-found]

    setup()


def fill(models: int, nodes: int, replicas: int = 1) -> None:
    from django.utils import timezone

    from catalog.models import AuditEntry, Model
    from fleet.models import Node, Replica, hash_token

    Replica.objects.all().delete()
    Model.objects.all().delete()
    Node.objects.all().delete()
    AuditEntry.objects.all().delete()
    now = timezone.now()
    per_node = max(1, -(-models * replicas // nodes)) + 1
    Node.objects.bulk_create(
        Node(
            name=f"node-{i:04d}",
            token_hash=hash_token(f"t{i}"),
            memory_gb=per_node,
            cores=per_node,
            last_heartbeat=now,
        )
        for i in range(nodes)
    )
    Model.objects.bulk_create(
        Model(
            name=f"model-{i:05d}",
            source=f"http://127.0.0.1:8000/mirror/acme/m{i}/abc/m{i}.gguf",
            min_replicas=replicas,
            max_replicas=max(replicas, 1),
            model_class=("critical", "standard", "opportunistic")[i % 3],
            profiles=[{"name": "cpu", "memory_gb": 1, "cores": 1, "gpus": 0, "gpu_memory_gb": 0}],
        )
        for i in range(models)
    )


def settle_facts() -> None:
    """Every model file's header asked for (here they do not answer): what a pass learns of the
    models' files a few at a time is learned, as in a fleet that has run for a while."""
    from catalog.models import Model
    from fleet.footprint import learn_facts

    while learn_facts(Model.objects.all()):
        pass


def timed_pass() -> tuple[float, float, int, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from fleet.reconciler import reconcile_pass

    with CaptureQueriesContext(connection) as captured:
        start, cpu = time.perf_counter(), time.process_time()
        report = reconcile_pass()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert not report.skipped
    return elapsed, cpu, len(captured.captured_queries), len(report.started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", default="100x10,1000x100,10000x1000")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of each model")
    args = parser.parse_args()
    print(
        "reconcile: one pass, simulated nodes (first = places every replica; steady = nothing to change)"
    )
    print(
        f"{'models':>7} {'nodes':>6} {'first pass':>11} {'queries':>8} {'started':>8} "
        f"{'steady pass':>12} {'its CPU':>8} {'queries':>8} {'quiet pass':>11} {'queries':>8}"
    )
    for pair in args.pairs.split(","):
        models, nodes = (int(x) for x in pair.split("x"))
        fill(models, nodes, args.replicas)
        first, _, first_queries, started = timed_pass()
        settle_facts()
        steady, steady_cpu, steady_queries, _ = timed_pass()
        quiet, _, quiet_queries, _ = timed_pass()
        print(
            f"{models:>7} {nodes:>6} {first * 1000:>9.0f}ms {first_queries:>8} {started:>8} "
            f"{steady * 1000:>10.0f}ms {steady_cpu * 1000:>6.0f}ms {steady_queries:>8} "
            f"{quiet * 1000:>9.0f}ms {quiet_queries:>8}"
        )


if __name__ == "__main__":
    main()
