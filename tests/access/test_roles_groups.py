"""The identity provider's groups mapped to teams and roles at each sign-in
(access.roles.apply_groups): what the mapping gave follows the groups, what staff gave by hand
stays, and every change is audited."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from access.models import ADMIN, GROUPS, MEMBER, TEAM_ADMIN, VIEWER, Team, TeamRole
from access.roles import Grant, apply_groups, parse_group_map
from access.services import group_mapping_add, team_add
from catalog.models import AuditEntry
from core.actor import SYSTEM, Actor
from core.refusals import Refused

pytestmark = [pytest.mark.django_db]

MAP = "llm-admins=admin, research=member:research, research-leads=team-admin:research, auditors=viewer"


@pytest.fixture(autouse=True)
def group_map(settings: Any) -> None:
    settings.LLMGW_OIDC_GROUP_MAP = MAP


def signs_in(user: Any, *groups: str) -> None:
    apply_groups(user, list(groups), actor=Actor.for_user(user, "console"))
    user.refresh_from_db()


def roles_of(user: Any) -> set[tuple[str, str | None, str]]:
    rows = TeamRole.objects.filter(user=user).select_related("team")
    return {(r.role, r.team.name if r.team else None, r.source) for r in rows}


def teams_of(user: Any) -> list[str]:
    return sorted(user.llmgw_teams.values_list("name", flat=True))


# -- the setting ------------------------------------------------------------------------------


def test_it_reads_the_mapping_strictly() -> None:
    assert parse_group_map(MAP) == [
        Grant("llm-admins", ADMIN),
        Grant("research", MEMBER, "research"),
        Grant("research-leads", TEAM_ADMIN, "research"),
        Grant("auditors", VIEWER),
    ]
    assert parse_group_map(" , ") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "research=boss:research",
            "LLMGW_OIDC_GROUP_MAP: the entry 'research=boss:research' is wrong: 'boss' is not a "
            "role; the roles are admin, team-admin, member, viewer.",
        ),
        (
            "ok=viewer, research",
            "LLMGW_OIDC_GROUP_MAP: the entry 'research' is wrong: write each entry as group=role "
            "or group=role:team.",
        ),
        (
            "research=member",
            "LLMGW_OIDC_GROUP_MAP: the entry 'research=member' is wrong: member is a role in a "
            "team: write research=member:TEAM.",
        ),
        (
            "ops=admin:ops",
            "LLMGW_OIDC_GROUP_MAP: the entry 'ops=admin:ops' is wrong: admin is a role over "
            "everything, in no team: write ops=admin.",
        ),
    ],
)
def test_a_wrong_entry_is_named(text: str, message: str) -> None:
    with pytest.raises(ImproperlyConfigured) as wrong:
        parse_group_map(text)
    assert str(wrong.value) == message


def test_a_wrong_mapping_stops_the_start(settings: Any) -> None:
    settings.LLMGW_OIDC_GROUP_MAP = "research=member"
    with pytest.raises(SystemCheckError, match="the entry 'research=member' is wrong"):
        call_command("check")


# -- at a sign-in -----------------------------------------------------------------------------


def test_groups_give_teams_and_roles_and_make_the_team(users: dict[str, Any]) -> None:
    carol = users["carol"]
    signs_in(carol, "research-leads", "auditors", "unmapped")
    assert teams_of(carol) == ["research"]
    assert roles_of(carol) == {
        (MEMBER, "research", GROUPS),
        (TEAM_ADMIN, "research", GROUPS),
        (VIEWER, None, GROUPS),
    }
    made = AuditEntry.objects.get(action="team-add")
    assert (made.model_name, made.actor_name, made.note) == (
        "team research",
        "carol",
        "made by the group mapping",
    )
    assert sorted(AuditEntry.objects.values_list("model_name", "action", "note")) == [
        ("team research", "role-add", "carol is a team admin (groups)"),
        ("team research", "team-add", "made by the group mapping"),
        ("team research", "team-member-add", "carol (groups)"),
        ("user carol", "role-add", "carol is a viewer (groups)"),
    ]
    # The same groups again change nothing.
    signs_in(carol, "research-leads", "auditors")
    assert AuditEntry.objects.count() == 4


def test_what_the_groups_no_longer_say_is_taken_away(users: dict[str, Any]) -> None:
    carol = users["carol"]
    signs_in(carol, "research-leads", "auditors")
    signs_in(carol, "research")
    assert teams_of(carol) == ["research"]
    assert roles_of(carol) == {(MEMBER, "research", GROUPS)}
    signs_in(carol, "llm-admins")
    assert teams_of(carol) == [] and carol.is_staff
    removed = AuditEntry.objects.filter(action__endswith="-remove").values_list("note", flat=True)
    assert sorted(removed) == [
        "carol (groups)",
        "carol is no longer a team admin",
        "carol is no longer a viewer",
    ]


def test_what_staff_gave_by_hand_stays(users: dict[str, Any]) -> None:
    alice = users["alice"]
    staff = Actor.for_user(users["staff"], "api")
    team_add(actor=staff, name="research", members=["alice"])
    team_add(actor=staff, name="support", members=["alice"])
    signs_in(alice, "research")
    # Already a member by hand: the mapping marks nothing, and so never takes it away.
    assert roles_of(alice) == set()
    signs_in(alice, "auditors")
    assert teams_of(alice) == ["research", "support"]
    # A staff flag given by hand stays too; the mapping unsets only what it set.
    signs_in(users["staff"], "auditors")
    assert users["staff"].is_staff


def test_the_admin_group_sets_and_unsets_staff_but_never_a_superusers(
    users: dict[str, Any],
) -> None:
    bob = users["bob"]
    signs_in(bob, "llm-admins")
    assert bob.is_staff and roles_of(bob) == {(ADMIN, None, GROUPS)}
    signs_in(bob, "auditors")
    assert not bob.is_staff
    entry = AuditEntry.objects.filter(model_name="user bob", action="role-remove").get()
    assert entry.note == "bob is no longer an admin (staff)"
    root = type(bob).objects.create_superuser("root", password="root-password-1")
    root.is_staff = False
    root.save()
    signs_in(root, "llm-admins")
    signs_in(root, "auditors")
    assert root.is_staff and root.is_superuser


def test_groups_that_map_to_nothing_are_refused_after_what_they_gave_is_gone(
    users: dict[str, Any],
) -> None:
    bob = users["bob"]
    signs_in(bob, "research", "llm-admins")
    with pytest.raises(Refused) as refused:
        apply_groups(bob, ["marketing", "sales"], actor=SYSTEM)
    assert (refused.value.status, refused.value.code) == (403, "no_role")
    assert refused.value.message == (
        "bob's groups (marketing, sales) map to no role in llmgw; ask an administrator to add a "
        "mapping (LLMGW_OIDC_GROUP_MAP)."
    )
    bob.refresh_from_db()
    assert teams_of(bob) == [] and not bob.is_staff
    with pytest.raises(Refused, match=r"^bob's groups \(none\) map to no role"):
        apply_groups(bob, [], actor=SYSTEM)


def test_rows_in_the_admin_map_groups_beside_the_setting(
    users: dict[str, Any], settings: Any
) -> None:
    settings.LLMGW_OIDC_GROUP_MAP = ""
    staff = Actor.for_user(users["staff"], "admin")
    team_add(actor=staff, name="support")
    group_mapping_add(actor=staff, group="helpdesk", role=TEAM_ADMIN, team="support")
    signs_in(users["bob"], "helpdesk")
    assert teams_of(users["bob"]) == ["support"]
    assert (TEAM_ADMIN, "support", GROUPS) in roles_of(users["bob"])
    with pytest.raises(Refused, match="'boss' is not a role"):
        group_mapping_add(actor=staff, group="x", role="boss")
    with pytest.raises(Refused, match=r"^Only staff may give or take away roles"):
        group_mapping_add(actor=Actor.for_user(users["bob"], "api"), group="x", role=VIEWER)
    assert Team.objects.filter(name="support").exists()
