"""`llmgw ctl key limits` and `team show` print each rate limit beside its use now (requests and
tokens in the last minute, requests in flight), and their --json gains those figures."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from access.services import key_create, team_add
from core.actor import Actor
from gateway.limits import SharedCounters
from tests.support.ctl import Ctl, ctl_as
from tests.support.gateway_files import admit, gateway_files

pytestmark = pytest.mark.django_db(transaction=True)

NOW = {"requests_last_minute": 2, "tokens_last_minute": 1500, "in_flight": 1}


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


@pytest.fixture
def counters(tmp_path: Path, settings: Any) -> Iterator[SharedCounters]:
    # The live server runs in a thread of this process: it reads the same settings.
    with gateway_files(tmp_path, settings) as mine:
        yield mine


@pytest.fixture
def key_in_use(users: dict[str, Any], counters: SharedCounters) -> int:
    """alice's key in the team research, one request in flight and one ended with 1,500 tokens."""
    team_add(
        actor=Actor.for_user(users["staff"], "cli"),
        name="research",
        limits={"rpm": 100, "tpm": 10_000},
        members=["alice"],
    )
    key = key_create(
        actor=Actor.for_user(users["alice"], "cli"),
        name="bot",
        team="research",
        limits={"max_parallel": 4},
    )[0]
    admit(counters, key)
    counters.release(admit(counters, key), tokens=1500)
    return key.pk


def test_team_show_prints_use_now_against_each_rate(ctl: Ctl, key_in_use: int) -> None:
    code, out, err = ctl("alice", "team", "show", "research")
    assert code == 0, err
    assert "  rpm               100 requests/min (2 used of 100 in the last minute)\n" in out
    assert (
        "  tpm               10,000 tokens/min (1,500 used of 10,000 in the last minute)\n" in out
    )
    assert "  max-parallel      no limit (1 used now)\n" in out
    assert "  tokens-per-day    no limit (0 used)\n" in out
    code, out, _ = ctl("alice", "team", "show", "research", "--json")
    usage = json.loads(out)["usage"]
    assert usage == {"requests_today": 0, "tokens_today": 0, "tokens_this_month": 0, **NOW}


def test_key_limits_prints_use_now_against_each_rate(ctl: Ctl, key_in_use: int) -> None:
    code, out, err = ctl("alice", "key", "limits", str(key_in_use), "--rpm", "50")
    assert code == 0, err
    assert "  rpm               50 requests/min (2 used of 50 in the last minute)\n" in out
    assert "  tpm               no limit (1,500 used in the last minute)\n" in out
    assert "  max-parallel      4 in flight (1 used of 4 now)\n" in out
    code, out, _ = ctl("alice", "keys", "--json")
    usage = json.loads(out)[0]["usage"]
    assert {name: usage[name] for name in NOW} == NOW


def test_a_key_the_gateway_does_not_count_prints_no_use_now(ctl: Ctl, key_in_use: int) -> None:
    code, out, err = ctl("alice", "key", "limits", str(key_in_use), "--max-parallel", "none")
    assert code == 0, err
    # Nothing of the key is limited any more: the gateway counts only its team, so the key's
    # own use now is not known, and nothing is printed for it rather than a 0.
    assert "  rpm               no limit\n" in out
    assert "  max-parallel      no limit\n" in out
    assert "in the last minute" not in out
    code, out, _ = ctl("alice", "keys", "--json")
    assert json.loads(out)[0]["usage"]["in_flight"] is None
