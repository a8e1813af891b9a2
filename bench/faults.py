"""The fault matrix, every cell: each fault (tests.support.faults.FAULTS: a part killed or stopped,
two at once, a PostgreSQL fail-over, a clock stepped, beat inside the worker) at a random moment of each
operation (OPERATIONS: scale, add, and the registry's serve, update-fetch, update-roll and
canary), with traffic through the gateway all along, on one whole llmgw (gateway, web, worker,
beat, two node agents running llama.cpp replicas, a registry of its own) on a PostgreSQL and a
Redis of its own. Each cell runs `--rounds` times (2: every cell twice), in an order drawn by
the seed; each run's line says where the operation was when the fault landed.

Prints, per fault x operation: the outcomes (completed / failed with a reason / lost), requests
sent and failed (excused: in flight on a killed gateway worker or sent to a killed engine, failed
cleanly), double placements, orphan engines, and the time from the fault to the operation done
with nothing left over; beside issue 22's targets: 0 lost, 0 double placements, 0 orphan engines,
0 failed requests outside the killed process.

Run: make bench, or .venv/bin/python bench/faults.py [--rounds 2] [--seed N] [--only FAULT]
[--operation OPERATION]
(LLMGW_FAULT_SEED sets the seed too).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    # System reads the run command's module, which needs Django's settings (not its database).
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    os.environ.setdefault("LLMGW_VAR_DIR", tempfile.mkdtemp(prefix="llmgw-bench-faults-var-"))
    os.environ.setdefault("LLMGW_CONFIG", "/nonexistent/server.yaml")
    import django

    django.setup()
    from tests.support import faults

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="runs of every cell")
    parser.add_argument("--seed", type=int, default=None, help="replay a run")
    parser.add_argument("--only", choices=faults.FAULTS, action="append", help="these faults")
    parser.add_argument(
        "--operation", choices=faults.OPERATIONS, action="append", help="these operations"
    )
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else faults.seed_from_environment()
    cells = [
        c
        for c in faults.all_cells()
        if (not args.only or c[0] in args.only) and (not args.operation or c[1] in args.operation)
    ]
    for fault in sorted({fault for fault, _ in cells}):
        why = faults.unavailable(fault)
        if why is not None:
            print(f"leaving out {fault}: {why}", flush=True)
            cells = [c for c in cells if c[0] != fault]
    runs = cells * args.rounds
    random.Random(seed).shuffle(runs)
    print(f"fault matrix: {len(runs)} runs, seed {seed} (--seed {seed} replays it)", flush=True)

    results: defaultdict[tuple[str, str], list[faults.CellResult]] = defaultdict(list)
    started = time.monotonic()
    broke_off = ""  # why the runs stopped before the last one
    with (
        tempfile.TemporaryDirectory(prefix="llmgw-bench-faults-") as folder,
        faults.fleet_in(Path(folder)) as fleet,
    ):
        for number, (fault, operation) in enumerate(runs):
            # Each run draws its moment from a seed of its own, made from the run's seed
            # and its place in the order: --seed replays the whole sequence.
            result = faults.run_cell(fleet, fault, operation, seed * 1000 + number)
            results[fault, operation].append(result)
            print(f"[{number + 1}/{len(runs)}] {result.describe()}", flush=True)
            try:
                fleet.reset()
            except AssertionError as exc:
                print(f"could not bring the fleet back after this run: {exc}")
                print(fleet.sys.log_tail(20))
                broke_off = (
                    f"stopped after run {number + 1} of {len(runs)}: the fleet did not come "
                    f"back after {fault} x {operation} ({exc})"
                )
                break
    print(f"\n{len(runs)} runs in {time.monotonic() - started:.0f} s, seed {seed}\n")

    head = (
        f"{'fault':<15} {'operation':<12} {'completed':>9} {'failed':>6} {'lost':>4} "
        f"{'sent':>5} {'failed':>6} {'excused':>7} {'double':>6} {'orphans':>7} "
        f"{'audit':>5} {'recover s (median, max)':>24}"
    )
    print(head)
    print("-" * len(head))
    totals: defaultdict[str, int] = defaultdict(int)
    for fault, operation in cells:
        rows = results.get((fault, operation), [])
        if not rows:
            continue
        completed = sum(r.outcome == "completed" for r in rows)
        failed = sum(r.outcome.startswith("failed") for r in rows)
        lost = sum(r.outcome == "lost" for r in rows)
        sent = sum(r.sent for r in rows)
        failed_requests = sum(r.failed for r in rows)
        excused = sum(r.excused for r in rows)
        double = sum(len(r.double_placements) for r in rows)
        orphans = sum(len(r.orphans) for r in rows)
        audit = sum(bool(r.audit_missing) for r in rows)
        times = [r.recover_seconds for r in rows if r.recover_seconds is not None]
        recover = f"{statistics.median(times):.1f}, {max(times):.1f}" if times else "-"
        print(
            f"{fault:<15} {operation:<12} {completed:>9} {failed:>6} {lost:>4} {sent:>5} "
            f"{failed_requests:>6} {excused:>7} {double:>6} {orphans:>7} {audit:>5} {recover:>24}"
        )
        totals["lost"] += lost
        totals["double"] += double
        totals["orphans"] += orphans
        totals["unexcused"] += failed_requests - excused
        totals["audit"] += audit
    print(
        f"\ntargets (issue 22): lost 0 (here {totals['lost']}), double placements 0 "
        f"(here {totals['double']}), orphan engines 0 (here {totals['orphans']}), failed "
        f"requests outside the killed process 0 (here {totals['unexcused']}); audit entries "
        f"missing: {totals['audit']}"
    )
    for rows in results.values():
        for r in rows:
            if not r.ok:
                print(f"NOT MET: {r.describe()}")
    if broke_off:
        print(f"NOT MET: {broke_off}")
    return 0 if not broke_off and all(r.ok for rows in results.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
