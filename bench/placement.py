"""The placement planner alone (no database) at 10,000 models over 1,000 nodes, the fleet
oversubscribed so that the plan has hundreds of preemptions and thousands of unplaced replicas:
wall time of one plan, the median of a few, beside the target of 10 s per plan.

Run: make bench (or .venv/bin/python bench/placement.py [--plans 3])
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.placement import plan_placement  # noqa: E402
from tests.support.placement import big_fleet  # noqa: E402

TARGET_SECONDS = 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plans", type=int, default=3)
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    args = parser.parse_args()
    # Memory scaled down so the fleet is oversubscribed: the costly case.
    nodes, models, replicas = big_fleet(
        seed=1, n_models=args.models, n_nodes=args.nodes, memory_scale=0.3
    )
    times = []
    for _ in range(args.plans):
        started = time.perf_counter()
        plan = plan_placement(nodes, models, replicas)
        times.append(time.perf_counter() - started)
    if not (plan.preemptions and plan.unplaced and plan.starts and plan.stops):
        sys.exit("placement bench: the fleet was not oversubscribed; the figure would mean little")
    median = statistics.median(times)
    print(f"placement: {args.models} models over {args.nodes} nodes, {len(replicas)} replicas")
    print(
        f"  plan: {len(plan.starts)} starts, {len(plan.stops)} stops, "
        f"{len(plan.preemptions)} preemptions, {len(plan.unplaced)} unplaced"
    )
    verdict = "met" if median < TARGET_SECONDS else "NOT met"
    print(
        f"  one plan: median {median:.2f} s of {args.plans} "
        f"(min {min(times):.2f}, max {max(times):.2f}); target < {TARGET_SECONDS:.0f} s: {verdict}"
    )


if __name__ == "__main__":
    main()
