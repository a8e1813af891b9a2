"""Teams: staff add them and set their limits and members; members see their own; every change
is in the audit with who made it (access.services, through /api/v1/teams)."""

from __future__ import annotations

from typing import Any

import pytest

from access.models import GatewayKey, Team
from access.services import key_create, team_add, team_members
from catalog.models import AuditEntry
from core.actor import Actor
from core.refusals import Refused


def staff_adds(users: dict[str, Any], name: str = "research", **limits: Any) -> Team:
    members = limits.pop("members", ["alice"])
    return team_add(
        actor=Actor.for_user(users["staff"], "api"), name=name, limits=limits, members=members
    )


def test_staff_add_a_team_with_limits_and_members(api: Any, users: dict[str, Any]) -> None:
    response = api("staff").post(
        "/api/v1/teams",
        {"name": "research", "tpm": 20000, "tokens_per_month": 10**9, "members": ["alice", "bob"]},
        format="json",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["members"] == ["alice", "bob"] and body["keys"] == 0
    assert body["limits"]["tpm"] == 20000 and body["limits"]["rpm"] is None
    assert body["usage"] == {
        "requests_today": 0,
        "tokens_today": 0,
        "tokens_this_month": 0,
        # Counted now (it has a tpm), by no gateway process yet.
        "requests_last_minute": 0,
        "tokens_last_minute": 0,
        "in_flight": 0,
    }
    entry = AuditEntry.objects.get(action="team-add")
    assert entry.model_name == "team research" and entry.actor_name == "staff"
    assert entry.after["members"] == ["alice", "bob"]


def test_only_staff_add_teams_and_set_their_limits_and_members(
    api: Any, users: dict[str, Any]
) -> None:
    refused = api("alice").post("/api/v1/teams", {"name": "mine"}, format="json")
    assert refused.status_code == 403
    assert refused.json() == {
        "detail": "Only staff may add teams; ask an administrator.",
        "code": "forbidden",
    }
    staff_adds(users)
    limits = api("alice").patch("/api/v1/teams/research", {"rpm": 1000}, format="json")
    assert limits.status_code == 403
    assert limits.json()["detail"] == "Only staff may set a team's limits; ask an administrator."
    members = api("alice").post("/api/v1/teams/research/members", {"add": ["carol"]}, format="json")
    assert members.status_code == 403
    assert Team.objects.get().rpm is None and list(Team.objects.get().members.all()) == [
        users["alice"]
    ]


def test_members_see_their_teams_and_outsiders_do_not(api: Any, users: dict[str, Any]) -> None:
    staff_adds(users)
    staff_adds(users, "support", members=["bob"])
    assert [t["name"] for t in api("alice").get("/api/v1/teams").json()] == ["research"]
    assert [t["name"] for t in api("staff").get("/api/v1/teams").json()] == ["research", "support"]
    assert api("alice").get("/api/v1/teams/research").status_code == 200
    hidden = api("alice").get("/api/v1/teams/support")
    assert hidden.status_code == 404
    assert hidden.json()["detail"] == (
        "There is no team named 'support' of yours; `llmgw ctl teams` lists them."
    )


def test_staff_change_limits_and_the_audit_says_who(api: Any, users: dict[str, Any]) -> None:
    staff_adds(users, rpm=100)
    response = api("staff").patch(
        "/api/v1/teams/research", {"rpm": 0, "max_parallel": 8, "models": ["a*"]}, format="json"
    )
    assert response.status_code == 200, response.json()
    limits = response.json()["limits"]
    assert limits["rpm"] is None and limits["max_parallel"] == 8 and limits["models"] == ["a*"]
    entry = AuditEntry.objects.get(action="team-limits")
    assert entry.actor_name == "staff" and entry.changes["rpm"] == [100, None]


def test_members_are_added_and_removed_and_audited(api: Any, users: dict[str, Any]) -> None:
    staff_adds(users)
    response = api("staff").post(
        "/api/v1/teams/research/members",
        {"add": ["bob", "carol"], "remove": ["alice"]},
        format="json",
    )
    assert response.status_code == 200
    assert response.json()["members"] == ["bob", "carol"]
    entry = AuditEntry.objects.get(action="team-members")
    assert entry.changes == {"members": [["alice"], ["bob", "carol"]]}


def test_an_unknown_member_is_refused_and_nothing_changes(api: Any, users: dict[str, Any]) -> None:
    staff_adds(users)
    response = api("staff").post(
        "/api/v1/teams/research/members", {"add": ["bob", "zed"]}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["detail"] == (
        "The change was refused, nothing was changed: members: there is no user named 'zed'."
    )
    assert [u.username for u in Team.objects.get().members.all()] == ["alice"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"name": "-dash"}, 400),
        ({"name": "has space"}, 400),
        ({"name": ""}, 400),
        ({"name": "research", "weight": -1}, 400),
        ({"name": "research", "models": ["no/slash"]}, 400),
        ({"name": "research", "members": ["nobody"]}, 400),
    ],
)
def test_bad_teams_are_refused_and_nothing_is_made(
    api: Any, users: dict[str, Any], body: dict[str, Any], status: int
) -> None:
    response = api("staff").post("/api/v1/teams", body, format="json")
    assert response.status_code == status, response.content
    assert response.json()["detail"]
    assert not Team.objects.exists()


def test_a_second_team_of_the_same_name_is_a_conflict(api: Any, users: dict[str, Any]) -> None:
    staff_adds(users)
    response = api("staff").post("/api/v1/teams", {"name": "research"}, format="json")
    assert response.status_code == 409
    assert response.json()["detail"] == (
        "There is already a team named 'research'; `llmgw ctl team limits research` changes "
        "its limits."
    )


def test_a_removed_teams_keys_stay_without_a_team(api: Any, users: dict[str, Any]) -> None:
    staff_adds(users)
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a", team="research")[0]
    response = api("staff").delete("/api/v1/teams/research")
    assert response.json() == {"name": "research", "keys": 1}
    assert GatewayKey.objects.get(pk=key.pk).team is None
    assert AuditEntry.objects.get(action="team-remove").note == "1 key(s) left without a team"


def test_a_teams_usage_is_its_keys_together(api: Any, users: dict[str, Any]) -> None:
    from datetime import UTC, datetime

    from access.models import KeyUsageDay

    staff_adds(users, members=["alice", "bob"])
    today = datetime.now(UTC).date()
    for user in ("alice", "bob"):
        key = key_create(actor=Actor.for_user(users[user], "api"), name="a", team="research")[0]
        KeyUsageDay.objects.create(
            key=key, model="m", day=today, requests=2, prompt_tokens=3, completion_tokens=4
        )
    team = api("alice").get("/api/v1/teams/research").json()
    assert team["keys"] == 2
    assert team["usage"]["requests_today"] == 4 and team["usage"]["tokens_today"] == 14


# -- the admin ----------------------------------------------------------------------------


def test_the_admin_adds_a_team_and_changes_its_members_through_the_services(
    client: Any, users: dict[str, Any]
) -> None:
    from django.contrib.auth import get_user_model

    root = get_user_model().objects.create_superuser("root", password="root-password-1")
    client.force_login(root)
    assert client.get("/admin/access/team/add/").status_code == 200
    form = {"name": "research", "members": [users["alice"].pk], "rpm": "100", "weight": "1"}
    assert client.post("/admin/access/team/add/", form).status_code == 302
    team = Team.objects.get()
    assert team.rpm == 100 and [u.username for u in team.members.all()] == ["alice"]
    assert AuditEntry.objects.get(action="team-add").door == "admin"

    url = f"/admin/access/team/{team.pk}/change/"
    form = {"name": "research", "members": [users["bob"].pk], "rpm": "", "weight": "0"}
    refused = client.post(url, form)
    assert refused.status_code == 200
    assert "weight: is a number above 0 and at most 1000, not 0.0" in refused.content.decode()
    assert [u.username for u in team.members.all()] == ["alice"]  # nothing half-written

    form["weight"] = "2"
    assert client.post(url, form).status_code == 302
    team.refresh_from_db()
    assert (team.rpm, team.weight) == (None, 2.0)
    assert [u.username for u in team.members.all()] == ["bob"]
    assert client.get("/admin/access/team/").status_code == 200

    # Removed through the service, with its audit entry, from the admin's delete page.
    delete = f"/admin/access/team/{team.pk}/delete/"
    assert client.get(delete).status_code == 200
    assert client.post(delete, {"post": "yes"}).status_code == 302
    assert not Team.objects.exists()
    assert AuditEntry.objects.get(action="team-remove").door == "admin"


def test_names_no_team_or_user_could_have_are_not_looked_up(
    api: Any, users: dict[str, Any]
) -> None:
    # A NUL cannot be held by PostgreSQL's text: a query with one fails rather than finding none.
    staff_adds(users)
    assert api("staff").get("/api/v1/teams/a%00b").status_code == 404
    response = api("staff").post(
        "/api/v1/teams/research/members", {"add": ["a\x00b"]}, format="json"
    )
    assert response.status_code == 400
    # And whatever door hands the service such a name:
    with pytest.raises(Refused, match="there is no user named 'a\\\\x00b'"):
        team_members(actor=Actor.for_user(users["staff"], "cli"), name="research", add=["a\x00b"])
    response = api("alice").post("/api/v1/keys", {"name": "k", "team": "re\x00"}, format="json")
    assert response.status_code == 400
    with pytest.raises(Refused, match="There is no team 're\\\\x00'"):
        key_create(actor=Actor.for_user(users["alice"], "cli"), name="k", team="re\x00")


def test_the_admin_removes_a_team_through_the_service(client: Any, users: dict[str, Any]) -> None:
    from django.contrib.auth import get_user_model

    root = get_user_model().objects.create_superuser("root", password="root-password-1")
    team = staff_adds(users)
    key_create(actor=Actor.for_user(users["alice"], "api"), name="a", team="research")
    client.force_login(root)
    response = client.post(f"/admin/access/team/{team.pk}/delete/", {"post": "yes"}, follow=True)
    assert "Its 1 key(s) stay, without the team&#x27;s limits." in response.content.decode()
    assert not Team.objects.exists() and GatewayKey.objects.get().team is None
    entry = AuditEntry.objects.get(action="team-remove")
    assert (entry.actor_name, entry.door) == ("root", "admin")
