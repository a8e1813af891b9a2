"""`llmgw ctl teams` and `team add/limits/members/show/remove` against a running server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from access.models import Team
from catalog.models import AuditEntry
from tests.support.ctl import Ctl, ctl_as

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


def test_staff_add_a_team_and_it_prints_what_is_in_force(ctl: Ctl) -> None:
    code, out, err = ctl(
        "staff",
        "team",
        "add",
        "research",
        "--tpm",
        "20000",
        "--tokens-per-day",
        "1,000,000",
        "--member",
        "alice,bob",
        "--models",
        "llama-*,qwen",
    )
    assert code == 0, err
    assert out.splitlines() == [
        "Team research added:",
        "  members           alice, bob",
        "  keys              0 active",
        "  rpm               no limit (0 used in the last minute)",
        "  tpm               20,000 tokens/min (0 used of 20,000 in the last minute)",
        "  max-parallel      no limit (0 used now)",
        "  tokens-per-day    1,000,000 tokens/day (0 used of 1,000,000)",
        "  tokens-per-month  no limit (0 used)",
        "  models            llama-*, qwen",
        "  weight            1",
        "  requests today    0",
    ]
    code, out, _ = ctl("alice", "teams")
    header, row = out.strip().splitlines()
    assert header.split() == ["NAME", "MEMBERS", "KEYS", "TOKENS", "TODAY", "LIMITS"]
    assert row.split()[:4] == ["research", "2", "0", "0"]
    assert "20,000 tokens/min, 1,000,000 tokens/day, models llama-*,qwen" in row
    code, out, _ = ctl("carol", "teams")
    assert out == "No teams yet. Staff add one with: llmgw ctl team add NAME [--rpm N ...]\n"


def test_limits_members_show_and_remove(ctl: Ctl) -> None:
    assert ctl("staff", "team", "add", "research")[0] == 0
    code, out, err = ctl("staff", "team", "limits", "research", "--rpm", "100", "--weight", "2")
    assert code == 0, err
    assert out.startswith("Team research now:\n")
    assert "  rpm               100 requests/min (0 used of 100 in the last minute)\n" in out
    assert "  weight            2\n" in out
    assert out.endswith("The gateway holds these within a second.\n")
    code, out, _ = ctl("staff", "team", "limits", "research", "--rpm", "none")
    assert "  rpm               no limit\n" in out

    code, out, _ = ctl("staff", "team", "members", "research", "--add", "alice", "--add", "bob")
    assert out == "Team research has 2 member(s): alice, bob.\n"
    code, out, _ = ctl("staff", "team", "members", "research", "--remove", "bob")
    assert out == "Team research has 1 member(s): alice.\n"
    assert [e.actor_name for e in AuditEntry.objects.filter(action="team-members")] == [
        "staff",
        "staff",
    ]
    assert AuditEntry.objects.filter(action="team-members").first().door == "cli"

    code, out, _ = ctl("alice", "team", "show", "research", "--json")
    assert json.loads(out)["members"] == ["alice"]
    code, out, _ = ctl("staff", "team", "remove", "research")
    assert out == "Team research removed; its 0 key(s) stay, without the team's limits.\n"
    assert not Team.objects.exists()


def test_refusals_are_printed_and_exit_non_zero(ctl: Ctl) -> None:
    code, out, err = ctl("alice", "team", "add", "mine")
    assert (code, out) == (1, "")
    assert err == "error: Only staff may add teams; ask an administrator.\n"
    code, _, err = ctl("staff", "team", "add", "research", "--member", "zed")
    assert err == (
        "error: The change was refused, nothing was changed: members: there is no user named "
        "'zed'.\n"
    )
    code, _, err = ctl("staff", "team", "members", "research")
    assert err == "error: say whom: --add USER or --remove USER (each may be repeated)\n"
    code, _, err = ctl("staff", "team", "show", "nowhere")
    assert err == (
        "error: There is no team named 'nowhere' of yours; `llmgw ctl teams` lists them.\n"
    )


def test_a_limit_flag_takes_a_number_or_none(ctl: Ctl, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        ctl("staff", "team", "add", "research", "--rpm", "lots")
    assert (
        "'lots' is not a limit: give a whole number, or 0 or none to lift it"
        in capsys.readouterr().err
    )
