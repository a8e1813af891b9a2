"""A team admin in the console: the Teams page's members form on their team's card, the keys in
their team on the Keys page (revoked and limited there, within what staff set); a member gets no
form and is refused naming the role; a viewer makes no keys."""

from __future__ import annotations

from typing import Any

import pytest

from access.models import VIEWER, GatewayKey, Team
from access.services import key_create, policy_set, role_give, team_add, team_members
from catalog.models import AuditEntry
from core.actor import Actor
from tests.console.pages import KEY_LIMITS_UNCHANGED, text_of

pytestmark = [pytest.mark.django_db]

TEAMS = {"HX-Request": "true", "HX-Current-URL": "http://testserver/teams/"}
KEYS = {"HX-Request": "true", "HX-Current-URL": "http://testserver/keys/"}


@pytest.fixture
def research(users: dict[str, Any]) -> Team:
    """research: alice its team admin, bob a member; its key policy's rpm ceiling is 100."""
    staff = Actor.for_user(users["staff"], "api")
    team = team_add(actor=staff, name="research", members=["alice", "bob"])
    team_members(actor=staff, name="research", add_admins=["alice"])
    policy_set(actor=staff, scope="team:research", ceilings={"rpm": 100})
    return team


def members_of() -> list[str]:
    return sorted(Team.objects.get(name="research").members.values_list("username", flat=True))


def key_of(users: dict[str, Any], name: str) -> GatewayKey:
    return key_create(actor=Actor.for_user(users[name], "api"), name=f"{name}-app")[0]


# -- the Teams page ---------------------------------------------------------------------------


def test_a_team_admin_gets_the_members_form_and_changes_members(
    client_for: Any, users: dict[str, Any], research: Team
) -> None:
    page = client_for("alice").get("/teams/")
    text = text_of(page)
    assert "team admins: alice" in text
    assert "As a team admin of research, you change its members here" in text
    html = page.content.decode()
    assert 'action="/teams/research/members"' in html
    assert 'action="/teams/research/limits"' not in html  # the team's limits stay staff's
    done = client_for("alice").post("/teams/research/members", {"add": "carol"}, headers=TEAMS)
    assert done.status_code == 200, text_of(done)
    assert "Team research has 3 member(s): alice, bob, carol." in text_of(done)
    assert members_of() == ["alice", "bob", "carol"]
    entry = AuditEntry.objects.get(action="team-members", door="console")
    assert entry.actor_name == "alice"
    limits = client_for("alice").post("/teams/research/limits", {"rpm": "9"}, headers=TEAMS)
    assert limits.status_code == 403
    assert "Only staff may set a team's limits; ask an administrator." in text_of(limits)


def test_a_member_gets_no_form_and_is_refused_naming_the_role(
    client_for: Any, users: dict[str, Any], research: Team
) -> None:
    page = client_for("bob").get("/teams/")
    assert 'action="/teams/research/members"' not in page.content.decode()
    refused = client_for("bob").post("/teams/research/members", {"remove": "alice"}, headers=TEAMS)
    assert refused.status_code == 403
    assert (
        "Changing the members of team research needs the team admin role in it (you are a "
        "member); ask a team admin or an administrator."
    ) in text_of(refused)
    assert members_of() == ["alice", "bob"]


# -- the Keys page ----------------------------------------------------------------------------


def test_a_team_admin_sees_limits_and_revokes_the_keys_in_their_team(
    client_for: Any, users: dict[str, Any], research: Team
) -> None:
    bobs = key_of(users, "bob")
    page = client_for("alice").get("/keys/")
    text = text_of(page)
    assert "Your gateway keys, and those in research, whose team admin you are" in text
    assert "bob-app" in text and "bob · team research" in text
    form = {**KEY_LIMITS_UNCHANGED, "team": "research", "weight": "1", "rpm": "100"}
    done = client_for("alice").post(f"/keys/{bobs.pk}/limits", {**form, "rpm": "40"}, headers=KEYS)
    assert done.status_code == 200, text_of(done)
    assert GatewayKey.objects.get(pk=bobs.pk).rpm == 40
    raised = client_for("alice").post(
        f"/keys/{bobs.pk}/limits", {**form, "rpm": "400"}, headers=KEYS
    )
    assert raised.status_code == 403
    assert "400 is above the ceiling of 100" in text_of(raised)
    revoked = client_for("alice").post(f"/keys/{bobs.pk}/revoke", headers=KEYS)
    assert revoked.status_code == 200
    assert GatewayKey.objects.get(pk=bobs.pk).revoked_by == users["alice"]


def test_a_member_is_refused_a_teammates_key(
    client_for: Any, users: dict[str, Any], research: Team
) -> None:
    alices = key_of(users, "alice")
    assert "alice-app" not in text_of(client_for("bob").get("/keys/"))
    refused = client_for("bob").post(f"/keys/{alices.pk}/revoke", headers=KEYS)
    assert refused.status_code == 403
    assert (
        "Managing the keys of team research needs the team admin role in it (you are a member)"
    ) in text_of(refused)
    assert GatewayKey.objects.get(pk=alices.pk).revoked_at is None


def test_a_viewer_gets_no_new_key_form(client_for: Any, users: dict[str, Any]) -> None:
    role_give(actor=Actor.for_user(users["staff"], "api"), username="carol", role=VIEWER)
    page = client_for("carol").get("/keys/")
    assert 'id="key-create-form"' not in page.content.decode()
    assert "You have the viewer role" in text_of(page)
    refused = client_for("carol").post("/keys/create", {"name": "mine"}, headers=KEYS)
    assert refused.status_code == 403
    assert "Making gateway keys needs the member role (you are a viewer)" in text_of(refused)
    assert not GatewayKey.objects.exists()


# -- the Usage page ---------------------------------------------------------------------------


def test_a_team_admin_sees_whose_each_team_key_is_on_the_usage_page(
    client_for: Any, users: dict[str, Any], research: Team
) -> None:
    from datetime import date

    from access.models import KeyUsageDay

    for name in ("alice", "bob"):
        KeyUsageDay.objects.create(
            key=key_of(users, name), day=date(2026, 12, 1), model="chat", requests=3
        )
    admin_page = text_of(client_for("alice").get("/usage/"))
    assert "for your own keys and those of the teams you are team admin of" in admin_page
    assert "bob-app" in admin_page and "Owner" in admin_page
    member_page = text_of(client_for("bob").get("/usage/"))
    assert "for your own keys." in member_page
    assert "alice-app" not in member_page and "Owner" not in member_page
