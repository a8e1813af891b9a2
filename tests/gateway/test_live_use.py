"""/api/v1/keys and /api/v1/teams give each key's and team's use now beside its rpm, tpm and
max_parallel: requests and tokens in the last minute and requests in flight, as this machine's
gateway processes count them in their files (gateway.limits.live_use), read once an answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from access import live
from access.models import GatewayKey
from access.services import key_create, team_add
from core.actor import Actor
from gateway.limits import SharedCounters
from tests.support.gateway_files import admit, gateway_files

pytestmark = pytest.mark.django_db


@pytest.fixture
def counters(tmp_path: Path, settings: Any) -> Iterator[SharedCounters]:
    with gateway_files(tmp_path, settings) as mine:
        yield mine


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each read of the gateway's files, with what it was asked about."""
    seen: list[dict[str, Any]] = []
    real = live.use_now

    def counted(**asked: Any) -> Any:
        seen.append({kind: [row.pk for row in rows] for kind, rows in asked.items()})
        return real(**asked)

    monkeypatch.setattr(live, "use_now", counted)
    return seen


def research_key(users: dict[str, Any], **limits: Any) -> GatewayKey:
    team_add(
        actor=Actor.for_user(users["staff"], "api"),
        name="research",
        limits={"rpm": 100, "tpm": 10_000},
        members=["alice"],
    )
    return key_create(
        actor=Actor.for_user(users["alice"], "api"), name="bot", team="research", limits=limits
    )[0]


def test_a_keys_and_its_teams_use_now_come_through(
    api: Any, users: dict[str, Any], counters: SharedCounters, reads: list[dict[str, Any]]
) -> None:
    key = research_key(users, max_parallel=4)
    admit(counters, key)  # still in flight
    counters.release(admit(counters, key), tokens=120)
    now = {"requests_last_minute": 2, "tokens_last_minute": 120, "in_flight": 1}

    listed = api("alice").get("/api/v1/keys").json()
    assert listed[0]["usage"] == {
        "requests_today": 0,
        "tokens_today": 0,
        "tokens_this_month": 0,
        **now,
    }
    assert listed[0]["limits"]["max_parallel"] == 4
    team = api("alice").get("/api/v1/teams/research").json()
    assert {name: team["usage"][name] for name in now} == now
    teams = api("staff").get("/api/v1/teams").json()
    assert {name: teams[0]["usage"][name] for name in now} == now
    research = {"keys": [], "teams": [key.team_id]}
    assert reads == [{"keys": [key.pk], "teams": []}, research, research]  # once an answer


def test_a_change_answers_with_the_use_now(
    api: Any, users: dict[str, Any], counters: SharedCounters
) -> None:
    key = research_key(users, rpm=50)
    admit(counters, key)
    changed = api("alice").patch(f"/api/v1/keys/{key.pk}/limits", {"rpm": 40}, format="json")
    assert changed.status_code == 200, changed.json()
    assert changed.json()["usage"]["requests_last_minute"] == 1
    assert changed.json()["usage"]["in_flight"] == 1
    team = api("staff").patch("/api/v1/teams/research", {"rpm": 90}, format="json").json()
    assert (team["limits"]["rpm"], team["usage"]["in_flight"]) == (90, 1)
    revoked = api("alice").post(f"/api/v1/keys/{key.pk}/revoke").json()
    assert revoked["usage"]["in_flight"] == 1  # the request let in before goes on to its end


def test_the_listing_reads_the_files_once_for_all_its_keys(
    api: Any, users: dict[str, Any], counters: SharedCounters, reads: list[dict[str, Any]]
) -> None:
    actor = Actor.for_user(users["alice"], "api")
    keys = [key_create(actor=actor, name=f"app {n}", limits={"rpm": 10})[0] for n in range(3)]
    for key in keys:
        admit(counters, key)
    listed = api("alice").get("/api/v1/keys").json()
    assert [k["usage"]["in_flight"] for k in listed] == [1, 1, 1]
    assert reads == [{"keys": [k.pk for k in reversed(keys)], "teams": []}]


def test_a_key_without_limits_has_no_figures_now(
    api: Any, users: dict[str, Any], counters: SharedCounters
) -> None:
    """The gateway does not count a key with no limit (it costs nothing there), so its use now
    is unknown: null, not a 0 that would call a busy key idle."""
    key = research_key(users)
    admit(counters, key)  # counted for its team, not for itself
    body = api("alice").get("/api/v1/keys").json()[0]
    assert body["usage"]["requests_last_minute"] is None
    assert body["usage"]["tokens_last_minute"] is None
    assert body["usage"]["in_flight"] is None
    assert api("alice").get("/api/v1/teams/research").json()["usage"]["in_flight"] == 1


def test_without_gateway_files_the_figures_are_0(
    api: Any, users: dict[str, Any], tmp_path: Path, settings: Any
) -> None:
    """No gateway process has run on this machine (no VAR_DIR/gateway-limits): nothing is in
    flight anywhere."""
    settings.VAR_DIR = tmp_path
    settings.LLMGW_LIMITS_REDIS = "off"
    key = research_key(users, rpm=5)
    body = api("alice").get("/api/v1/keys").json()[0]
    assert (body["id"], body["usage"]["requests_last_minute"], body["usage"]["in_flight"]) == (
        key.pk,
        0,
        0,
    )
