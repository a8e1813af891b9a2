"""The limit flags that `key create`, `key limits`, `team add` and `team limits` share, and how a
key's or team's limits print: each limit beside what was used against it (today, this month, in
the last minute, now)."""

from __future__ import annotations

import argparse
from typing import Any

from llmgw.limitdefs import LIMITS

# flag -> the API's field, and what the limit counts (for --help and for printing)
COUNTERS = {limit.name: (limit.meaning, limit.short) for limit in LIMITS}
# The usage figure each limit is counted against (the API's usage fields), and over when. The
# rates' figures are null for a key or team the gateway does not count (it has no limit at all).
USED = {limit.name: (limit.used, limit.used_when) for limit in LIMITS}


def add_limit_flags(parser: Any, *, key: bool) -> None:
    """The limits as flags; a flag not given leaves that limit as it is."""
    for field, (meaning, _) in COUNTERS.items():
        parser.add_argument(
            f"--{field.replace('_', '-')}",
            dest=field,
            type=counter_flag,
            metavar="N",
            help=f"{meaning}; 0 or none lifts the limit",
        )
    parser.add_argument(
        "--models",
        type=_models,
        metavar="A,B",
        help="the models and adapters it may use, by name or glob (llama-*); none for every model",
    )
    parser.add_argument(
        "--weight",
        type=float,
        metavar="W",
        help="its share of a model's slots when requests queue for them (default 1)"
        + ("; only staff set a key's above 1, or above its team's" if key else ""),
    )
    if key:
        parser.add_argument(
            "--team",
            help="a team you are a member of, whose limits it also counts against; none for no team",
        )
        parser.add_argument(
            "--expires",
            metavar="DURATION|DATE",
            help="when it stops working: a duration from now (30d, 12h), a date (00:00 UTC that "
            "day) or an ISO 8601 time; none for never",
        )


def limits_body(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as the API takes them."""
    fields = [*COUNTERS, "models", "weight", "team", "expires"]
    return {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}


def counter_flag(text: str) -> int:
    """A limit as a flag gives it: a whole number (1,000 and 1_000 too); 0 or none lifts it."""
    if text.strip().lower() == "none":
        return 0
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a limit: give a whole number, or 0 or none to lift it"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a limit: 0 or none lifts it")
    return value


def _models(text: str) -> list[str]:
    if text.strip().lower() in ("", "none", "all"):
        return []
    return [name.strip() for name in text.split(",") if name.strip()]


def limit_lines(view: dict[str, Any]) -> list[str]:
    """A key's or team's limits, one a line, with what was used against each where it is known."""
    limits, usage = view["limits"], view.get("usage") or {}
    lines = []
    for field, (_, unit) in COUNTERS.items():
        figure = limits[field]
        name, when = USED[field]
        used = usage.get(name)
        shown = "no limit" if figure is None else f"{figure:,} {unit}"
        if used is not None:
            against = f"{used:,} used" if figure is None else f"{used:,} used of {figure:,}"
            shown += f" ({against}{when})"
        lines.append(f"  {field.replace('_', '-'):<17} {shown}")
    models = ", ".join(limits["models"]) if limits["models"] else "every model"
    lines.append(f"  {'models':<17} {models}")
    lines.append(f"  {'weight':<17} {limits['weight']:g}")
    if "usage" in view:
        lines.append(f"  {'requests today':<17} {usage.get('requests_today', 0):,}")
    return lines


def limits_summary(limits: dict[str, Any]) -> str:
    """The limits set, on one line, for a table: "60 requests/min, 1,000 tokens/day"."""
    parts = [
        f"{limits[field]:,} {unit}"
        for field, (_, unit) in COUNTERS.items()
        if limits[field] is not None
    ]
    if limits["models"]:
        parts.append("models " + ",".join(limits["models"]))
    if limits["weight"] != 1:
        parts.append(f"weight {limits['weight']:g}")
    return ", ".join(parts) or "none"
