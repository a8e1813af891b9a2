"""The commands a hint gives to paste start with the `llmgw` command as it was typed
(llmgw.ctl.output.program, which tests/llmgw_site/test_first_lines.py holds to what the README
types): unit tests of the printing, with a client that answers from a dict."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from llmgw.ctl import gateway, teams

TYPED = "/srv/llmgw/.venv/bin/llmgw"


class Answers:
    """A client whose GETs answer from `paths` (no server: only the printing is tested here)."""

    def __init__(self, paths: dict[str, Any]) -> None:
        self.paths = paths

    def get(self, path: str) -> Any:
        return self.paths[path]


@pytest.mark.parametrize(
    ("module", "run", "path", "hint"),
    [
        (gateway, gateway.cmd_keys, "keys", f"Create one with: {TYPED} ctl key create NAME"),
        (teams, teams.cmd_teams, "teams", f"Staff add one with: {TYPED} ctl team add NAME"),
    ],
)
def test_an_empty_lists_hint_names_the_command_as_typed(
    module: Any,
    run: Any,
    path: str,
    hint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(module, "program", lambda: TYPED)
    run(Answers({path: []}), argparse.Namespace(json=False))
    assert hint in capsys.readouterr().out
