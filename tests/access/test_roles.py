"""Roles (access.roles): the one table every door asks, the refusals that name the role needed,
and what a team admin does through the API; a user with no role row does what they did before."""

from __future__ import annotations

from typing import Any

import pytest

from access import roles
from access.models import GROUPS, HAND, TEAM_ADMIN, VIEWER, GatewayKey, KeyUsageDay, Team, TeamRole
from access.services import key_create, policy_set, role_give, team_add, team_members
from catalog.models import AuditEntry
from core.actor import Actor
from core.refusals import Refused

pytestmark = [pytest.mark.django_db]

MEMBERS_REFUSED = (
    "Changing the members of team research needs the team admin role in it (you are a member); "
    "ask a team admin or an administrator."
)
KEYS_REFUSED = (
    "Managing the keys of team research needs the team admin role in it (you are a member); "
    "ask a team admin or an administrator."
)


def as_(user: Any, door: str = "api") -> Actor:
    return Actor.for_user(user, door)


@pytest.fixture
def research(users: dict[str, Any]) -> Team:
    """research: alice (its team admin), bob and carol members; a key policy whose ceiling of
    tokens_per_day is 5,000."""
    staff = as_(users["staff"])
    team = team_add(actor=staff, name="research", members=["alice", "bob", "carol"])
    team_members(actor=staff, name="research", add_admins=["alice"])
    policy_set(actor=staff, scope="team:research", ceilings={"tokens_per_day": 5000})
    return team


def key_of(users: dict[str, Any], name: str, **given: Any) -> GatewayKey:
    key, _ = key_create(actor=as_(users[name]), name=f"{name}-app", **given)
    return key


# -- the table --------------------------------------------------------------------------------


def test_it_gives_each_role_what_the_table_says(users: dict[str, Any], research: Team) -> None:
    TeamRole.objects.create(user=users["carol"], role=VIEWER)
    dave = type(users["alice"]).objects.create_user("dave", password="dave-password-1")
    TeamRole.objects.create(user=dave, role=VIEWER)
    alice, bob, carol = (as_(users[n]) for n in ("alice", "bob", "carol"))
    staff, viewer = as_(users["staff"]), as_(dave)
    assert [roles.may(a, "team.members", team=research) for a in (staff, alice, bob, viewer)] == [
        True,
        True,
        False,
        False,
    ]
    assert [roles.may(a, "keys.make") for a in (staff, alice, bob, carol, viewer)] == [
        True,
        True,
        True,
        True,  # a viewer who is also a member of a team makes keys there
        False,
    ]
    assert [roles.may(a, "usage.read-all") for a in (staff, alice, bob, viewer)] == [
        True,
        False,
        False,
        True,
    ]
    assert not roles.may(alice, "team.limits") and roles.may(staff, "team.limits")
    assert roles.role_in(alice, research) == TEAM_ADMIN and roles.role_in(viewer) == VIEWER


def test_a_user_with_no_role_row_does_what_they_did_before(users: dict[str, Any]) -> None:
    bob = as_(users["bob"])
    assert roles.roles_of(bob) == {roles.MEMBER}
    assert roles.may(bob, "keys.make")
    key = key_of(users, "bob")
    assert key.owner == users["bob"]
    assert roles.role_in(as_(users["staff"])) == roles.ADMIN


def test_a_refusal_names_the_role_needed_and_the_one_held(
    users: dict[str, Any], research: Team
) -> None:
    with pytest.raises(Refused) as refused:
        roles.require(as_(users["bob"]), "team.keys", team=research)
    assert (refused.value.message, refused.value.status) == (KEYS_REFUSED, 403)
    dave = type(users["alice"]).objects.create_user("dave", password="dave-password-1")
    with pytest.raises(Refused) as refused:
        roles.require(as_(dave), "team.members", team=research)
    assert refused.value.message == (
        "Changing the members of team research needs the team admin role in it (you have no "
        "role in it); ask a team admin or an administrator."
    )
    TeamRole.objects.create(user=dave, role=VIEWER)
    with pytest.raises(Refused) as refused:
        roles.require(as_(dave), "keys.make")
    assert refused.value.message == (
        "Making gateway keys needs the member role (you are a viewer); ask an administrator."
    )
    # What only admins do keeps the words every staff-only refusal has.
    with pytest.raises(Refused, match=r"^Only staff may set a team's limits; ask an admin"):
        roles.require(as_(users["alice"]), "team.limits")


# -- a viewer ---------------------------------------------------------------------------------


def test_a_viewer_makes_no_keys_and_reads_everyones_usage(
    api: Any, users: dict[str, Any], research: Team
) -> None:
    key = key_of(users, "bob")
    KeyUsageDay.objects.create(key=key, model="chat", day="2026-12-01", writer="w", requests=3)
    role_give(actor=as_(users["staff"]), username="carol", role=VIEWER)
    team_members(actor=as_(users["staff"]), name="research", remove=["carol"])
    refused = api("carol").post("/api/v1/keys", {"name": "mine"}, format="json")
    assert refused.status_code == 403
    assert refused.json() == {
        "detail": "Making gateway keys needs the member role (you are a viewer); ask an "
        "administrator.",
        "code": "forbidden",
    }
    assert not GatewayKey.objects.filter(owner=users["carol"]).exists()
    usage = api("carol").get("/api/v1/usage").json()
    assert [(row["owner"], row["requests"]) for row in usage] == [("bob", 3)]
    assert [t["name"] for t in api("carol").get("/api/v1/teams").json()] == ["research"]
    assert api("carol").get("/api/v1/models").status_code == 200
    entry = AuditEntry.objects.get(action="role-add")
    assert (entry.model_name, entry.note) == ("user carol", "carol is a viewer")


# -- a team admin through the API -------------------------------------------------------------


def test_a_team_admin_changes_their_teams_members_and_a_member_may_not(
    api: Any, users: dict[str, Any], research: Team
) -> None:
    refused = api("bob").post("/api/v1/teams/research/members", {"add": ["staff"]}, format="json")
    assert refused.status_code == 403
    assert refused.json()["detail"] == MEMBERS_REFUSED
    done = api("alice").post("/api/v1/teams/research/members", {"remove": ["carol"]}, format="json")
    assert done.status_code == 200, done.json()
    assert done.json()["members"] == ["alice", "bob"] and done.json()["admins"] == ["alice"]
    entry = AuditEntry.objects.filter(action="team-members").latest("id")
    assert (entry.actor_name, entry.changes) == (
        "alice",
        {"members": [["alice", "bob", "carol"], ["alice", "bob"]]},
    )


def test_only_staff_give_the_team_admin_role_and_a_team_admin_keeps_their_peers(
    api: Any, users: dict[str, Any], research: Team
) -> None:
    refused = api("alice").post(
        "/api/v1/teams/research/members", {"add_admins": ["bob"]}, format="json"
    )
    assert refused.status_code == 403
    assert refused.json()["detail"] == (
        "Only staff may give or take away the team admin role; ask an administrator."
    )
    given = api("staff").post(
        "/api/v1/teams/research/members", {"add_admins": ["bob"]}, format="json"
    )
    assert given.json()["admins"] == ["alice", "bob"]
    assert TeamRole.objects.get(user=users["bob"], role=TEAM_ADMIN).source == HAND
    entry = AuditEntry.objects.filter(action="team-admins").latest("id")
    assert entry.changes == {"admins": [["alice"], ["alice", "bob"]]}
    peer = api("alice").post("/api/v1/teams/research/members", {"remove": ["bob"]}, format="json")
    assert peer.status_code == 403
    assert peer.json()["detail"] == (
        "Only staff may remove a team admin from a team; ask an administrator."
    )
    # Staff removing a team admin from the team takes their role in it away too.
    api("staff").post("/api/v1/teams/research/members", {"remove": ["bob"]}, format="json")
    assert not TeamRole.objects.filter(user=users["bob"]).exists()


def test_a_team_admin_may_not_change_the_teams_limits_or_policy(
    api: Any, users: dict[str, Any], research: Team
) -> None:
    limits = api("alice").patch("/api/v1/teams/research", {"rpm": 1000}, format="json")
    assert limits.json()["detail"] == "Only staff may set a team's limits; ask an administrator."
    policy = api("alice").patch(
        "/api/v1/keys/policies/team:research", {"ceilings": {"rpm": 9}}, format="json"
    )
    assert policy.json()["detail"] == "Only staff may set key policies; ask an administrator."
    assert Team.objects.get().rpm is None


def test_a_team_admin_sees_revokes_and_limits_the_keys_in_their_team(
    api: Any, users: dict[str, Any], research: Team
) -> None:
    bobs = key_of(users, "bob")
    outside = key_of(users, "staff")
    listed = api("alice").get("/api/v1/keys").json()
    assert [k["id"] for k in listed] == [bobs.pk]
    limited = api("alice").patch(
        f"/api/v1/keys/{bobs.pk}/limits", {"tokens_per_day": 1000, "rpm": 30}, format="json"
    )
    assert limited.status_code == 200, limited.json()
    assert limited.json()["limits"]["tokens_per_day"] == 1000
    entry = AuditEntry.objects.filter(action="key-limits").latest("id")
    assert (entry.actor_name, entry.model_name) == ("alice", f"key #{bobs.pk}")
    # Not past what staff set: the team's key policy's ceiling holds a team admin too.
    raised = api("alice").patch(
        f"/api/v1/keys/{bobs.pk}/limits", {"tokens_per_day": 6000}, format="json"
    )
    assert raised.status_code == 403
    assert (
        "6,000 is above the ceiling of 5,000 that the team research's key policy sets"
        in (raised.json()["detail"])
    )
    moved = api("alice").patch(f"/api/v1/keys/{bobs.pk}/limits", {"team": None}, format="json")
    assert moved.json()["detail"] == (
        "Only staff may move another person's key into or out of a team; ask an administrator."
    )
    revoked = api("alice").post(f"/api/v1/keys/{bobs.pk}/revoke")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
    assert revoked.json()["revoked_by"] == "alice"
    # A key outside their team stays hidden.
    assert api("alice").post(f"/api/v1/keys/{outside.pk}/revoke").status_code == 404


def test_a_member_is_refused_a_teammates_key_naming_the_role(
    api: Any, users: dict[str, Any], research: Team
) -> None:
    alices = key_of(users, "alice")
    assert [k["id"] for k in api("bob").get("/api/v1/keys").json()] == []
    for refused in (
        api("bob").post(f"/api/v1/keys/{alices.pk}/revoke"),
        api("bob").patch(f"/api/v1/keys/{alices.pk}/limits", {"rpm": 1}, format="json"),
    ):
        assert refused.status_code == 403
        assert refused.json()["detail"] == KEYS_REFUSED
    assert GatewayKey.objects.get(pk=alices.pk).revoked_at is None
    # Someone in no team with it is told there is no such key, as before.
    team_members(actor=as_(users["staff"]), name="research", remove=["carol"])
    assert api("carol").post(f"/api/v1/keys/{alices.pk}/revoke").status_code == 404


def test_a_team_admin_sees_the_usage_of_their_teams_keys(
    api: Any, users: dict[str, Any], research: Team
) -> None:
    for name in ("bob", "staff"):
        key = key_of(users, name)
        KeyUsageDay.objects.create(key=key, model="chat", day="2026-12-01", writer="w", requests=2)
    assert [r["owner"] for r in api("alice").get("/api/v1/usage").json()] == ["bob"]
    assert api("bob").get("/api/v1/usage").json()[0]["owner"] == "bob"
    assert [r["owner"] for r in api("carol").get("/api/v1/usage").json()] == []


def test_an_outsider_is_told_there_is_no_such_team(api: Any, users: dict[str, Any]) -> None:
    team_add(actor=as_(users["staff"]), name="research", members=["alice"])
    refused = api("bob").post("/api/v1/teams/research/members", {"add": ["bob"]}, format="json")
    assert refused.status_code == 404
    assert refused.json()["detail"] == (
        "There is no team named 'research' of yours; `llmgw ctl teams` lists them."
    )


def test_a_role_in_the_mapping_is_taken_over_when_staff_give_it_by_hand(
    users: dict[str, Any], research: Team
) -> None:
    row = TeamRole.objects.get(user=users["alice"], role=TEAM_ADMIN)
    row.source = GROUPS
    row.save()
    team_members(actor=as_(users["staff"]), name="research", add_admins=["alice"])
    assert TeamRole.objects.get(user=users["alice"], role=TEAM_ADMIN).source == HAND
