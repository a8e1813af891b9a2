"""Running `llmgw ctl` in the test process, as one of the named users."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmgw.cli import main

Ctl = Callable[..., tuple[int, str, str]]


def ctl_as(url: str, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    """ctl("alice", "models") runs `llmgw ctl models` as alice against ``url``; returns
    (exit code, stdout, stderr)."""
    monkeypatch.setenv("LLMGW_URL", url)

    def run(user: str, *argv: str) -> tuple[int, str, str]:
        monkeypatch.setenv("LLMGW_TOKEN", tokens[user])
        code = main(["ctl", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run
