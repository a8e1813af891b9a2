"""How `llmgw ctl` prints: JSON for --json, aligned tables, a model's scaling in words."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any


def program() -> str:
    """The `llmgw` command as it was typed, for the commands a hint gives to paste: what the
    README types (`.venv/bin/llmgw`, from the checkout) when run so, `llmgw` when run from the
    PATH or in any other way."""
    invoked = sys.argv[0] if sys.argv else ""
    if os.path.basename(invoked) != "llmgw":
        return "llmgw"  # python -m llmgw, or inside another program (the tests)
    found = shutil.which("llmgw")
    if found is not None and os.path.exists(invoked) and os.path.samefile(found, invoked):
        return "llmgw"
    return invoked


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def table_wanted(args: Any, items: list[Any], none: str) -> bool:
    """Whether a list command goes on to print its table. Not with --json: the items are
    printed as the API gave them. Not when there are none: ``none`` is printed instead,
    which says how to make one."""
    if args.json:
        print_json(items)
        return False
    if not items:
        print(none)
        return False
    return True


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
