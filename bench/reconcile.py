"""One reconcile pass at 100, 1,000 and 10,000 models over 10, 100 and 1,000 simulated nodes:
wall time and SQL queries, for the first pass (placing everything) and a steady pass (nothing to do).

Run: make bench (or .venv/bin/python bench/reconcile.py [--pairs 100x10,1000x100])
"""

from __future__ import annotations

import argparse
import time

if __name__ == "__main__":
    from _django import setup  # type: ignore[import-not-found]

    setup()


def fill(models: int, nodes: int) -> None:
    from django.utils import timezone

    from catalog.models import AuditEntry, Model
    from fleet.models import Node, Replica, hash_token

    Replica.objects.all().delete()
    Model.objects.all().delete()
    Node.objects.all().delete()
    AuditEntry.objects.all().delete()
    now = timezone.now()
    per_node = max(1, -(-models // nodes)) + 1
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
            min_replicas=1,
            model_class=("critical", "standard", "opportunistic")[i % 3],
            profiles=[{"name": "cpu", "memory_gb": 1, "cores": 1, "gpus": 0, "gpu_memory_gb": 0}],
        )
        for i in range(models)
    )


def timed_pass() -> tuple[float, int, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from fleet.reconciler import reconcile_pass

    with CaptureQueriesContext(connection) as captured:
        start = time.perf_counter()
        report = reconcile_pass()
        elapsed = time.perf_counter() - start
    assert not report.skipped
    return elapsed, len(captured.captured_queries), len(report.started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", default="100x10,1000x100,10000x1000")
    args = parser.parse_args()
    print(
        "reconcile: one pass, simulated nodes (first = places every replica; steady = nothing to change)"
    )
    print(
        f"{'models':>7} {'nodes':>6} {'first pass':>11} {'queries':>8} {'started':>8} {'steady pass':>12} {'queries':>8}"
    )
    for pair in args.pairs.split(","):
        models, nodes = (int(x) for x in pair.split("x"))
        fill(models, nodes)
        first, first_queries, started = timed_pass()
        steady, steady_queries, _ = timed_pass()
        print(
            f"{models:>7} {nodes:>6} {first * 1000:>9.0f}ms {first_queries:>8} {started:>8} {steady * 1000:>10.0f}ms {steady_queries:>8}"
        )


if __name__ == "__main__":
    main()
