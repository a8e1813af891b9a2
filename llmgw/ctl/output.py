"""How `llmgw ctl` prints: JSON for --json, aligned tables, a model's scaling in words."""

from __future__ import annotations

import json
import sys
from typing import Any


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def scaling_text(view: dict[str, Any]) -> str:
    s = view["scaling"]
    if s["parked"]:
        return "not running (min 0, max 0)"
    if s["on_demand"]:
        return f"on demand (up to {s['max']}, idle {s['idle_timeout']})"
    return f"{s['min']} (max {s['max']})"
