"""The Teams page: staff add teams, set their limits and members and remove them; a member sees
their own teams read-only; an outsider sees none. Every change goes through access.services, so
it is in the audit with who made it, and a refused one changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from access.models import Team
from access.services import key_create, team_add
from catalog.models import AuditEntry
from core.actor import Actor
from gateway.limits import SharedCounters
from tests.console.pages import TEAM_LIMITS_UNCHANGED, text_of
from tests.support.gateway_files import admit
from tests.support.gateway_files import gateway_files as files_of_a_gateway

pytestmark = [pytest.mark.django_db]

HTMX = {"HX-Request": "true", "HX-Current-URL": "http://testserver/teams/"}
UNCHANGED = TEAM_LIMITS_UNCHANGED


def add_team(users: dict[str, Any], name: str = "research", **limits: Any) -> Team:
    members = limits.pop("members", ["alice", "bob"])
    return team_add(
        actor=Actor.for_user(users["staff"], "api"), name=name, limits=limits, members=members
    )


def members_of(name: str = "research") -> list[str]:
    return sorted(Team.objects.get(name=name).members.values_list("username", flat=True))


def console_entries() -> list[str]:
    return list(
        AuditEntry.objects.filter(door="console").order_by("id").values_list("action", flat=True)
    )


# -- who sees what ----------------------------------------------------------------------------


@pytest.mark.smoke
def test_staff_see_every_team_with_its_members_limits_and_use(
    client_for: Any, users: dict[str, Any]
) -> None:
    add_team(users, rpm=60, tokens_per_day=1000)
    add_team(users, "support", members=[])
    response = client_for("staff").get("/teams/")
    assert response.status_code == 200
    html, text = response.content.decode(), text_of(response)
    assert 'aria-current="page">Teams</a>' in html
    assert "research 2 members members: alice, bob · 0 active keys" in text
    assert "Requests in the last minute 0 of 60 (0%)" in text
    assert "Tokens today 0 of 1,000 (0%)" in text
    assert "0 requests today · Requests per minute: 60 · Tokens per minute: no limit" in text
    assert "support 0 members members: none" in text
    # support has no limit: the gateway counts nothing of it, so no 0 is shown as its use now.
    assert "The gateway counts the team's use per minute and in flight once it has a limit." in text
    assert 'id="team-create-form"' in html and "Remove team" in text


def test_a_member_sees_only_their_teams_without_forms(
    client_for: Any, users: dict[str, Any]
) -> None:
    add_team(users, rpm=60, members=["alice"])
    add_team(users, "support", members=["bob"])
    response = client_for("alice").get("/teams/")
    assert response.status_code == 200
    html, text = response.content.decode(), text_of(response)
    assert "research" in text and "support" not in text
    assert "Requests in the last minute 0 of 60 (0%)" in text
    for form in ("team-create-form", "/teams/research/limits", "/teams/research/members"):
        assert form not in html
    assert "Remove team" not in text
    outsider = text_of(client_for("carol").get("/teams/"))
    assert "research" not in outsider and "support" not in outsider
    assert "You are in no team yet; staff add members." in outsider


def test_the_page_needs_a_login(client: Any) -> None:
    response = client.get("/teams/")
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_use_now_comes_from_the_gateways_files_read_once_for_the_page(
    client_for: Any,
    users: dict[str, Any],
    gateway_files: SharedCounters,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    add_team(users, rpm=60, max_parallel=4)
    add_team(users, "support", tpm=1000)
    key = key_create(
        actor=Actor.for_user(users["alice"], "api"), name="bot", team="research", limits={}
    )[0]
    admit(gateway_files, key)
    finished = admit(gateway_files, key)
    gateway_files.release(finished, tokens=120)
    from access import live

    reads: list[int] = []
    real = live.use_now
    monkeypatch.setattr(live, "use_now", lambda **kw: reads.append(1) or real(**kw), raising=True)
    text = text_of(client_for("staff").get("/teams/"))
    assert "Requests in the last minute 2 of 60 (3%)" in text
    assert "Tokens in the last minute 120, no limit" in text
    assert "In flight now 1 of 4 (25%)" in text
    assert "Tokens in the last minute 0 of 1,000 (0%)" in text  # support's
    assert len(reads) == 1


# -- staff change teams -----------------------------------------------------------------------


@pytest.mark.smoke
def test_staff_add_a_team_and_the_audit_says_who(client_for: Any, users: dict[str, Any]) -> None:
    response = client_for("staff").post(
        "/teams/create",
        {"name": "research", "members": "alice, bob", "rpm": "60", "models": "llama-*"},
        headers=HTMX,
    )
    assert response.status_code == 201, text_of(response)
    assert response.content.decode().lstrip().startswith('<div id="teams-body">')
    assert text_of(response).count("Team research added.") == 1  # once, on top, not in its card
    team = Team.objects.get()
    assert (team.rpm, team.models, members_of()) == (60, ["llama-*"], ["alice", "bob"])
    entry = AuditEntry.objects.get(action="team-add")
    assert (entry.model_name, entry.actor_name, entry.door) == ("team research", "staff", "console")
    assert entry.after["members"] == ["alice", "bob"] and entry.after["rpm"] == 60


@pytest.mark.parametrize(
    ("form", "status", "message"),
    [
        ({"name": ""}, 400, "Give the team a name, like research or support."),
        (
            {"name": "research", "rpm": "lots"},
            400,
            "The team was refused, nothing was changed: rpm: is a whole number from 1 up, or 0 "
            "or none for no limit, not 'lots'.",
        ),
        (
            {"name": "research", "members": "alice, zed"},
            400,
            "The change was refused, nothing was changed: members: there is no user named 'zed'.",
        ),
        (
            {"name": "taken"},
            409,
            "There is already a team named 'taken'; `llmgw ctl team limits taken` changes its "
            "limits.",
        ),
    ],
)
def test_a_refused_team_shows_why_and_adds_nothing(
    client_for: Any, users: dict[str, Any], form: dict[str, str], status: int, message: str
) -> None:
    add_team(users, "taken", members=[])
    response = client_for("staff").post("/teams/create", form, headers=HTMX)
    assert response.status_code == status
    assert message in text_of(response)
    assert list(Team.objects.values_list("name", flat=True)) == ["taken"]
    assert console_entries() == []


def test_staff_set_a_teams_limits_and_only_what_changed_is_sent(
    client_for: Any, users: dict[str, Any]
) -> None:
    team = add_team(users, tpm=5000)
    form = {**UNCHANGED, "tpm": "5000"}
    response = client_for("staff").post(
        "/teams/research/limits", {**form, "rpm": "120", "weight": "2"}, headers=HTMX
    )
    assert response.status_code == 200, text_of(response)
    html = response.content.decode()
    assert html.lstrip().startswith('<article class="card key team" id="team-research"')
    assert "Limits in force now; the gateway holds them within a second." in text_of(response)
    team.refresh_from_db()
    assert (team.rpm, team.tpm, team.weight) == (120, 5000, 2.0)
    entry = AuditEntry.objects.get(action="team-limits")
    assert set(entry.changes) == {"rpm", "weight"}
    assert (entry.actor_name, entry.door) == ("staff", "console")


def test_a_refused_limit_shows_why_beside_it_and_changes_nothing(
    client_for: Any, users: dict[str, Any]
) -> None:
    team = add_team(users, rpm=60)
    response = client_for("staff").post(
        "/teams/research/limits",
        {**UNCHANGED, "rpm": "-1", "tpm": "100", "weight": "0"},
        headers=HTMX,
    )
    assert response.status_code == 400
    text = text_of(response)
    assert (
        "The change was refused, nothing was changed: rpm: is a whole number from 1 up, or 0 or "
        "none for no limit, not '-1'; weight: is a number above 0 and at most 1000, not '0'."
    ) in text
    team.refresh_from_db()
    assert (team.rpm, team.tpm, team.weight) == (60, None, 1.0)
    assert console_entries() == []


def test_staff_add_and_remove_members(client_for: Any, users: dict[str, Any]) -> None:
    add_team(users)
    response = client_for("staff").post(
        "/teams/research/members", {"add": "carol", "remove": "bob"}, headers=HTMX
    )
    assert response.status_code == 200, text_of(response)
    text = text_of(response)
    assert "Team research has 2 member(s): alice, carol." in text
    assert "members: alice, carol" in text
    assert members_of() == ["alice", "carol"]
    entry = AuditEntry.objects.get(action="team-members", door="console")
    assert (entry.before, entry.after) == (
        {"members": ["alice", "bob"]},
        {"members": ["alice", "carol"]},
    )
    assert entry.actor_name == "staff"


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"add": "", "remove": " "}, "Say whom to add or remove: give at least one username."),
        (
            {"add": "carol zed"},
            "The change was refused, nothing was changed: members: there is no user named 'zed'.",
        ),
        (
            {"add": "carol", "remove": "carol"},
            "The change was refused, nothing was changed: members: carol is both added and "
            "removed; say which.",
        ),
    ],
)
def test_a_refused_members_change_changes_nothing(
    client_for: Any, users: dict[str, Any], form: dict[str, str], message: str
) -> None:
    add_team(users)
    response = client_for("staff").post("/teams/research/members", form, headers=HTMX)
    assert response.status_code == 400
    assert message in text_of(response)
    assert members_of() == ["alice", "bob"]
    assert console_entries() == []


def test_staff_remove_a_team_and_its_keys_stay_without_one(
    client_for: Any, users: dict[str, Any]
) -> None:
    add_team(users, rpm=60)
    key = key_create(
        actor=Actor.for_user(users["alice"], "api"), name="bot", team="research", limits={}
    )[0]
    response = client_for("staff").post("/teams/research/remove", headers=HTMX)
    assert response.status_code == 200
    assert response.content.decode().lstrip().startswith('<div id="teams-body">')
    text = text_of(response)
    assert "Team research removed; its 1 key(s) stay, without the team's limits." in text
    assert "No teams yet" in text
    assert not Team.objects.exists()
    key.refresh_from_db()
    assert key.team is None
    entry = AuditEntry.objects.get(action="team-remove")
    assert (entry.model_name, entry.actor_name, entry.door) == ("team research", "staff", "console")
    assert entry.note == "1 key(s) left without a team"


def test_a_plain_form_post_answers_with_the_page(client_for: Any, users: dict[str, Any]) -> None:
    add_team(users)
    client = client_for("staff")
    done = client.post("/teams/research/limits", {**UNCHANGED, "rpm": "30"}, follow=True)
    assert done.redirect_chain == [("/teams/", 302)]
    assert "Limits in force now; the gateway holds them within a second." in text_of(done)
    refused = client.post("/teams/research/limits", {**UNCHANGED, "rpm": "x"})
    assert refused.status_code == 400
    assert "rpm: is a whole number from 1 up" in text_of(refused)
    assert Team.objects.get().rpm == 30
    gone = client.post("/teams/research/remove", follow=True)
    assert "Team research removed; its 0 key(s) stay" in text_of(gone)


# -- the others may not ----------------------------------------------------------------------


def test_a_member_cannot_change_their_team(client_for: Any, users: dict[str, Any]) -> None:
    add_team(users, rpm=60)
    alice = client_for("alice")
    limits = alice.post("/teams/research/limits", {**UNCHANGED, "rpm": "6000"}, headers=HTMX)
    assert limits.status_code == 403
    assert "Only staff may set a team's limits; ask an administrator." in text_of(limits)
    members = alice.post("/teams/research/members", {"add": "carol"}, headers=HTMX)
    assert members.status_code == 403
    assert (
        "Changing the members of team research needs the team admin role in it (you are a "
        "member); ask a team admin or an administrator."
    ) in text_of(members)
    removed = alice.post("/teams/research/remove", headers=HTMX)
    assert removed.status_code == 403
    assert "Only staff may remove teams; ask an administrator." in text_of(removed)
    added = alice.post("/teams/create", {"name": "mine"}, headers=HTMX)
    assert added.status_code == 403
    assert "Only staff may add teams; ask an administrator." in text_of(added)
    team = Team.objects.get()
    assert (team.name, team.rpm, members_of()) == ("research", 60, ["alice", "bob"])
    assert console_entries() == []


def test_an_outsider_is_told_there_is_no_such_team(client_for: Any, users: dict[str, Any]) -> None:
    add_team(users, rpm=60)
    carol = client_for("carol")
    for path, form in [
        ("/teams/research/limits", {**UNCHANGED, "rpm": "1"}),
        ("/teams/research/members", {"add": "carol"}),
        ("/teams/research/remove", {}),
    ]:
        response = carol.post(path, form, headers=HTMX)
        assert response.status_code == 404
        assert "There is no team named 'research' of yours; the Teams page lists them." in (
            text_of(response)
        )
    assert (Team.objects.get().rpm, members_of()) == (60, ["alice", "bob"])
    assert console_entries() == []


# -- the gateway's files ---------------------------------------------------------------------


@pytest.fixture
def gateway_files(tmp_path: Path, settings: Any) -> Iterator[SharedCounters]:
    with files_of_a_gateway(tmp_path, settings) as counters:
        yield counters
