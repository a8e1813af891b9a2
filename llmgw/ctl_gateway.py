"""`llmgw ctl` commands for the gateway (API keys)."""

from __future__ import annotations

from typing import Any


def add_commands(sub: Any) -> None:
    """Registers the gateway's commands on `llmgw ctl`'s sub-parsers."""
