"""`llmgw ctl key create` and `key limits` with limits, team and expiry, against a running server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from access.models import GatewayKey
from access.services import team_add
from core.actor import Actor
from tests.support.ctl import Ctl, ctl_as

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


def test_a_key_is_created_with_its_limits_and_prints_them(ctl: Ctl, users: dict[str, Any]) -> None:
    team_add(
        actor=Actor.for_user(users["staff"], "cli"),
        name="research",
        limits={"rpm": 100},
        members=["alice"],
    )
    code, out, err = ctl(
        "alice",
        "key",
        "create",
        "bot",
        "--team",
        "research",
        "--rpm",
        "60",
        "--models",
        "llama-*",
        "--expires",
        "2999-01-31",
        "--weight",
        "0.5",
    )
    assert code == 0, err
    key = GatewayKey.objects.get()
    assert (key.team.name, key.rpm, key.models, key.weight) == ("research", 60, ["llama-*"], 0.5)
    assert "  team              research\n" in out
    assert "  expires           2999-01-31 00:00:00 UTC\n" in out
    assert "  rpm               60 requests/min (0 used of 60 in the last minute)\n" in out
    assert "  models            llama-*\n" in out
    code, out, _ = ctl("alice", "keys", "--json")
    listed = json.loads(out)[0]
    assert listed["team"] == "research" and listed["limits"]["rpm"] == 60
    assert listed["usage"] == {
        "requests_today": 0,
        "tokens_today": 0,
        "tokens_this_month": 0,
        "requests_last_minute": 0,
        "tokens_last_minute": 0,
        "in_flight": 0,
    }


def test_key_limits_changes_only_what_is_given(ctl: Ctl) -> None:
    ctl("alice", "key", "create", "bot", "--rpm", "60", "--tpm", "1000")
    key = GatewayKey.objects.get()
    code, out, err = ctl("alice", "key", "limits", str(key.pk), "--rpm", "none")
    assert code == 0, err
    assert out.splitlines()[0] == f"Gateway key {key.pk} ({key.prefix}…, bot, owned by alice):"
    assert "  rpm               no limit (0 used in the last minute)\n" in out
    assert "  tpm               1,000 tokens/min (0 used of 1,000 in the last minute)\n" in out
    assert out.endswith("The gateway holds these within a second.\n")
    key.refresh_from_db()
    assert (key.rpm, key.tpm) == (None, 1000)


def test_a_limit_above_the_teams_is_refused_saying_its_figure(
    ctl: Ctl, users: dict[str, Any]
) -> None:
    team_add(
        actor=Actor.for_user(users["staff"], "cli"),
        name="research",
        limits={"tokens_per_day": 5000},
        members=["alice"],
    )
    code, out, err = ctl(
        "alice", "key", "create", "bot", "--team", "research", "--tokens-per-day", "9000"
    )
    assert (code, out) == (1, "")
    assert err == (
        "error: The key was refused, nothing was changed: tokens_per_day: 9,000 is above the team "
        "research's 5,000; a key's limit is at most its team's (ask staff to raise the team's).\n"
    )
    assert not GatewayKey.objects.exists()
    code, _, err = ctl("alice", "key", "create", "bot", "--expires", "soonish")
    assert err.startswith("error: The key was refused, nothing was changed: expires: 'soonish' is")
