"""`llmgw ctl audit`: who changed what, newest first."""

from __future__ import annotations

import argparse
import json
from typing import Any

from llmgw.client import Client

from .commands import command
from .output import table, table_wanted


def add_audit(sub: Any) -> None:
    p = command(sub, "audit", "who changed what, newest first", run=cmd_audit)
    p.add_argument("--model")
    p.add_argument("--actor")
    p.add_argument("--action")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_audit(client: Client, args: argparse.Namespace) -> None:
    page = client.get(
        "audit", model=args.model, actor=args.actor, action=args.action, limit=args.limit
    )
    entries = page["entries"]
    if not table_wanted(args, entries, "No audit entries match."):
        return
    rows = []
    for e in entries:
        changed = ", ".join(
            f"{k}: {_short(v[0])} -> {_short(v[1])}" for k, v in e["changes"].items()
        )
        if e["action"] in ("add", "remove"):
            changed = e["note"] or ""
        rows.append(
            [
                e["at"][:19].replace("T", " "),
                e["actor"],
                e["door"],
                e["action"],
                e["model"],
                changed or e["note"],
            ]
        )
    print(table(rows, ["WHEN (UTC)", "ACTOR", "DOOR", "ACTION", "MODEL", "CHANGE"]))


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
