"""`llmgw ctl model traffic NAME`: what the gateway answered for a model over the last hour, day
or week, and how its requests fared in the fair queue (the console's model page shows the same)."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import quote

from llmgw.client import Client

from .commands import command
from .output import print_json, table

WINDOWS = ("hour", "day", "week")


def add_model_traffic(msub: Any) -> None:
    p = command(
        msub,
        "traffic",
        "a model's requests, errors, latency, tokens and queue time through the gateway",
        "The gateway's figures for one model over the last hour (a row a minute), "
        "day (15 minutes) or week (an hour): requests, errors, latency, tokens, and the requests "
        "that waited in the gateway's fair queue because every slot of the model's replicas was "
        "busy (how many, how long on average and at most, how many timed out or found the queue "
        "full), with the requests waiting now, and the slowest request with its ID (X-Request-ID), "
        "to find its log lines and trace by. The gateway processes write their figures every "
        "few seconds; waiting now counts the gateway processes on the server's machine.",
        run=cmd_model_traffic,
    )
    p.add_argument("name")
    p.add_argument("--window", choices=WINDOWS, default="hour", help="default: hour")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_model_traffic(client: Client, args: argparse.Namespace) -> None:
    view = client.get(f"models/{quote(args.name, safe='')}/traffic", window=args.window)
    if args.json:
        print_json(view)
        return
    print("\n".join(summary_lines(view)))
    if view["points"]:
        print()
        print(points_table(view))


def summary_lines(view: dict[str, Any]) -> list[str]:
    total = view["total"]
    step = view["step_seconds"] // 60
    lines = [f"{view['model']} through the gateway in the last {view['window']}:"]
    if not total["requests"] and not total["queued"] and not total["queue_full"]:
        lines.append("  no requests (the gateway writes its figures every few seconds)")
    else:
        lines.append(
            f"  {_many(total['requests'], 'request')}, "
            f"{_many(total['client_errors'], 'client error')} (4xx), "
            f"{_many(total['server_errors'], 'server error')} (5xx), latency p50 "
            f"{_seconds(total['latency_p50_seconds'])}, p95 {_seconds(total['latency_p95_seconds'])}"
        )
        lines.append(
            f"  {total['prompt_tokens']:,} prompt and {total['completion_tokens']:,} completion "
            "tokens"
        )
        slowest = slowest_text(total)
        if slowest:
            lines.append(f"  slowest request: {slowest}")
            lines.append(
                "    (its log lines: grep the ID in var/log/; its trace: search llmgw.request_id "
                "in your tracing backend)"
            )
    lines.append(f"  queue: {queue_text(total)}")
    lines.append(f"  waiting for a free slot now: {view['waiting_now']:,}")
    if view["points"]:
        lines.append(f"  a row is {_many(step, 'minute')} (UTC)")
    return lines


def queue_text(figures: dict[str, Any]) -> str:
    """The fair queue's figures in words: "3 requests waited (mean 0.84 s, longest 2.10 s)..."."""
    if not figures["queued"]:
        waited = "no request waited for a free slot"
    else:
        waited = (
            f"{_many(figures['queued'], 'request')} waited for a free slot (mean "
            f"{_seconds(figures['queue_seconds_mean'])}, longest "
            f"{_seconds(figures['queue_seconds_max'])})"
        )
    return (
        f"{waited}; {figures['queue_timeouts']:,} timed out (503), "
        f"{figures['queue_full']:,} refused as the queue was full (429)"
    )


def slowest_text(figures: dict[str, Any]) -> str:
    """The slowest answer in words, "2.31 s, ID abc...", or "" without one (no answers, or a
    server of before these figures)."""
    if not figures.get("slowest_seconds"):
        return ""
    return f"{_seconds(figures['slowest_seconds'])}, ID {figures.get('slowest_request') or '-'}"


def points_table(view: dict[str, Any]) -> str:
    rows = [
        [
            p["start"][:16].replace("T", " "),
            f"{p['requests']:,}",
            f"{p['client_errors']:,}",
            f"{p['server_errors']:,}",
            _seconds(p["latency_p50_seconds"]),
            _seconds(p["latency_p95_seconds"]),
            f"{p['prompt_tokens']:,}",
            f"{p['completion_tokens']:,}",
            f"{p['queued']:,}",
            _seconds(p["queue_seconds_mean"]),
            _seconds(p["queue_seconds_max"]) if p["queued"] else "-",
            f"{p['queue_timeouts']:,}",
            f"{p['queue_full']:,}",
            _seconds(p["slowest_seconds"]) if p.get("slowest_seconds") else "-",
            p.get("slowest_request") or "-",
        ]
        for p in view["points"]
    ]
    header = [
        "FROM (UTC)",
        "REQUESTS",
        "4XX",
        "5XX",
        "P50",
        "P95",
        "PROMPT TOKENS",
        "COMPLETION TOKENS",
        "QUEUED",
        "QUEUE MEAN",
        "QUEUE MAX",
        "TIMED OUT",
        "QUEUE FULL",
        "SLOWEST",
        "SLOWEST REQUEST",
    ]
    return table(rows, header)


def _many(count: int, thing: str) -> str:
    return f"{count:,} {thing}{'' if count == 1 else 's'}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
