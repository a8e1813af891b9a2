"""`llmgw ctl model update NAME --canary PERCENT ...` and `llmgw ctl model canary show|promote|abort
NAME`: updates that first serve a share of the requests from one replica, judged by the gateway's
figures and rolled back by themselves when unhealthy."""

from __future__ import annotations

import argparse
import math
from typing import Any

from llmgw.client import Client

from .commands import command
from .output import print_json, program, table


def add_canary_flags(p: argparse.ArgumentParser) -> None:
    """The update command's canary flags; checked by the server (the same rules as the console)."""
    p.add_argument(
        "--canary",
        type=int,
        metavar="PERCENT",
        help="first one replica on the new files gets PERCENT of the model's requests (1-99), the "
        "rest going to the old ones; the control plane compares the two and goes on, one replica "
        "at a time, when the new one is healthy through --for, or rolls back by itself when not",
    )
    p.add_argument(
        "--for",
        dest="canary_for",
        metavar="DURATION",
        help="with --canary, how long the canary serves before it is promoted (default 10m)",
    )
    p.add_argument(
        "--max-error-rate",
        type=_finite,
        metavar="R",
        help="with --canary, the share of the new revision's answers that may be server errors "
        "before it is rolled back (default 0.05)",
    )
    p.add_argument(
        "--max-latency-ratio",
        type=_finite,
        metavar="X",
        help="with --canary, how many times slower than the old revision the new one may answer "
        "on average before it is rolled back (default 2)",
    )


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def canary_body(args: argparse.Namespace) -> dict[str, Any] | None:
    """The update's body: None for a plain update (the server refuses canary flags without
    --canary, saying so)."""
    body = {
        "canary": args.canary,
        "for": args.canary_for,
        "max_error_rate": args.max_error_rate,
        "max_latency_ratio": args.max_latency_ratio,
    }
    given = {k: v for k, v in body.items() if v is not None}
    return given or None


def add_model_canary(msub: Any) -> None:
    p = command(
        msub,
        "canary",
        "a canary update: its state and both revisions' figures; promote or abort it",
        "show: the canary's state, its settings and what the last check found. promote: "
        "the other replicas move to the new revision now, one at a time. abort: back to the old "
        "revision now; the canary replica goes, the old ones serve on. Promote and abort are the "
        "model owner's or staff's, and audited.",
        run=cmd_model_canary,
    )
    p.add_argument("action", choices=["show", "promote", "abort"])
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_model_canary(client: Client, args: argparse.Namespace) -> None:
    if args.action == "show":
        view = client.get(f"models/{args.name}/canary")
    else:
        view = client.post(f"models/{args.name}/canary/{args.action}", None)
    if args.json:
        print_json(view)
        return
    print(describe(view))
    if args.action == "promote":
        print(
            f"The other replicas move to it one at a time: {program()} ctl model update {args.name} "
            "--wait"
        )
    elif args.action == "abort":
        print("The canary replica leaves; the old replicas, which never stopped, serve on.")


def describe(view: dict[str, Any]) -> str:
    """A canary in a few lines: what it is, where it stands, both revisions' figures."""
    head = (
        f"{view['model']}: canary of {view['to_commit'][:7] or view['revision']} "
        f"(from {view['from_commit'][:7] or view['from_revision']}), {view['state']}"
    )
    lines = [head]
    if view["state"] == "waiting":
        lines.append(
            f"  waiting for its replica to be ready; it then gets {view['percent']}% of the requests"
        )
    else:
        lines.append(
            f"  {view['percent']}% of the requests for {view['window']} (window "
            f"{(view['started_at'] or '?')[11:19]} - {(view['ends_at'] or '?')[11:19]} UTC), "
            f"{view['checks']} checks"
        )
    lines.append(
        f"  rolled back when server errors exceed {view['max_error_rate']:.1%} or latency is "
        f"{view['max_latency_ratio']:g} times the old revision's"
    )
    lines.append(figures_table(view))
    if view["verdict"] and view["active"]:
        lines.append(f"  last check: {view['verdict']}")
    if view["decision"]:
        lines.append(f"  {view['state']} by {view['decided_by'] or 'system'}: {view['decision']}")
    return "\n".join(lines)


def figures_table(view: dict[str, Any]) -> str:
    rows = []
    for side, commit in (("old", view["from_commit"]), ("new", view["to_commit"])):
        seen = view[side]
        latency = "-" if seen["mean_latency"] is None else f"{seen['mean_latency']:.3f} s"
        rows.append(
            [
                f"  {side}",
                commit[:7],
                str(seen["requests"]),
                f"{seen['server_errors']} ({seen['error_rate']:.1%})",
                latency,
            ]
        )
    return table(rows, ["  REVISION", "COMMIT", "REQUESTS", "SERVER ERRORS", "MEAN LATENCY"])
