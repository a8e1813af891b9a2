"""Roles in the admin (staff's door): team admins given on a team's page, viewers on the roles
page, the provider's groups on the group mappings page; each through the services, audited."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from access.models import TEAM_ADMIN, VIEWER, GroupMapping, Team, TeamRole
from access.services import team_add
from catalog.models import AuditEntry
from core.actor import Actor
from tests.console.pages import text_of

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def admin_client(users: dict[str, Any]) -> Client:
    root = get_user_model().objects.create_superuser("root", password="root-password-1")
    client = Client()
    client.force_login(root)
    return client


@pytest.fixture
def research(users: dict[str, Any]) -> Team:
    return team_add(actor=Actor.for_user(users["staff"], "api"), name="research", members=["bob"])


def test_a_teams_page_gives_and_takes_the_team_admin_role(
    admin_client: Client, users: dict[str, Any], research: Team
) -> None:
    url = f"/admin/access/team/{research.pk}/change/"
    assert admin_client.get(url).status_code == 200
    form = {"name": "research", "members": [users["bob"].pk], "admins": [users["alice"].pk]}
    answer = admin_client.post(url, {**form, "weight": "1"})
    assert answer.status_code == 302, text_of(answer)
    assert sorted(research.members.values_list("username", flat=True)) == ["alice", "bob"]
    assert TeamRole.objects.get(role=TEAM_ADMIN).user == users["alice"]
    entry = AuditEntry.objects.get(action="team-admins")
    assert (entry.door, entry.changes) == ("admin", {"admins": [[], ["alice"]]})
    listing = admin_client.get("/admin/access/team/")
    assert "alice" in text_of(listing)
    form["admins"] = []
    form["members"] = [users["alice"].pk, users["bob"].pk]
    assert admin_client.post(url, {**form, "weight": "1"}).status_code == 302
    assert not TeamRole.objects.exists()
    assert sorted(research.members.values_list("username", flat=True)) == ["alice", "bob"]


def test_the_roles_page_gives_and_takes_the_viewer_role(
    admin_client: Client, users: dict[str, Any]
) -> None:
    assert admin_client.get("/admin/access/teamrole/add/").status_code == 200
    answer = admin_client.post(
        "/admin/access/teamrole/add/", {"user": users["carol"].pk, "role": VIEWER}
    )
    assert answer.status_code == 302, text_of(answer)
    row = TeamRole.objects.get()
    assert (row.user, row.role, row.source) == (users["carol"], VIEWER, "hand")
    assert AuditEntry.objects.get(action="role-add").door == "admin"
    assert admin_client.get("/admin/access/teamrole/").status_code == 200
    refused = admin_client.post(
        "/admin/access/teamrole/add/", {"user": users["carol"].pk, "role": TEAM_ADMIN}
    )
    assert "a team admin's role is in a team: say which team" in text_of(refused)
    delete = f"/admin/access/teamrole/{row.pk}/delete/"
    assert admin_client.post(delete, {"post": "yes"}).status_code == 302
    assert not TeamRole.objects.exists()
    assert AuditEntry.objects.get(action="role-remove").note == "carol is no longer a viewer"


def test_the_group_mappings_page_maps_a_group_to_a_role(
    admin_client: Client, research: Team
) -> None:
    answer = admin_client.post(
        "/admin/access/groupmapping/add/",
        {"group": "research-leads", "role": TEAM_ADMIN, "team": research.pk},
    )
    assert answer.status_code == 302, text_of(answer)
    assert str(GroupMapping.objects.get()) == "research-leads=team-admin:research"
    refused = admin_client.post(
        "/admin/access/groupmapping/add/", {"group": "leads", "role": TEAM_ADMIN}
    )
    assert "team-admin is a role in a team: write leads=team-admin:TEAM" in text_of(refused)
    assert GroupMapping.objects.count() == 1
    entry = AuditEntry.objects.get(action="group-mapping-add")
    assert (entry.model_name, entry.door) == ("group mapping research-leads", "admin")
