"""A team admin through `llmgw ctl` (against a running server): the team's members and keys,
within what staff set; a member is refused, naming the role needed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from access.models import GatewayKey, Team
from access.services import key_create, policy_set, team_add
from catalog.models import AuditEntry
from core.actor import Actor
from tests.support.ctl import Ctl, ctl_as

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


@pytest.fixture
def research(users: dict[str, Any]) -> Team:
    staff = Actor.for_user(users["staff"], "api")
    team = team_add(actor=staff, name="research", members=["alice", "bob"])
    policy_set(actor=staff, scope="team:research", ceilings={"rpm": 100})
    return team


def test_staff_give_the_team_admin_role_and_the_team_admin_changes_members(
    ctl: Ctl, research: Team
) -> None:
    code, out, err = ctl("staff", "team", "members", "research", "--add-admin", "alice")
    assert code == 0, err
    assert out == "Team research has 2 member(s): alice, bob.\nIts team admins: alice.\n"
    code, out, err = ctl("alice", "team", "members", "research", "--add", "carol")
    assert code == 0, err
    assert out.splitlines()[0] == "Team research has 3 member(s): alice, bob, carol."
    entry = AuditEntry.objects.filter(action="team-members").latest("id")
    assert (entry.actor_name, entry.door) == ("alice", "cli")
    code, out, _ = ctl("alice", "team", "show", "research")
    assert "  team admins       alice\n" in out
    assert json.loads(ctl("bob", "team", "show", "research", "--json")[1])["admins"] == ["alice"]


def test_a_member_is_refused_naming_the_role(ctl: Ctl, research: Team) -> None:
    code, out, err = ctl("bob", "team", "members", "research", "--remove", "alice")
    assert (code, out) == (1, "")
    assert err == (
        "error: Changing the members of team research needs the team admin role in it (you are "
        "a member); ask a team admin or an administrator.\n"
    )
    code, _, err = ctl("bob", "team", "members", "research", "--add-admin", "bob")
    assert err.startswith("error: Changing the members of team research needs the team admin")
    assert sorted(Team.objects.get().members.values_list("username", flat=True)) == [
        "alice",
        "bob",
    ]


def test_a_team_admin_lists_limits_and_revokes_their_teams_keys(
    ctl: Ctl, users: dict[str, Any], research: Team
) -> None:
    ctl("staff", "team", "members", "research", "--add-admin", "alice")
    key, _ = key_create(actor=Actor.for_user(users["bob"], "cli"), name="bobs-app")
    code, out, _ = ctl("alice", "keys", "--json")
    assert [(k["id"], k["owner"]) for k in json.loads(out)] == [(key.pk, "bob")]
    code, out, err = ctl("alice", "key", "limits", str(key.pk), "--rpm", "50")
    assert code == 0, err
    assert GatewayKey.objects.get(pk=key.pk).rpm == 50
    code, _, err = ctl("alice", "key", "limits", str(key.pk), "--rpm", "500")
    assert code == 1 and "500 is above the ceiling of 100" in err
    code, _, err = ctl("bob", "key", "limits", str(key.pk), "--rpm", "60")
    assert code == 0, err  # the owner still sets their own
    code, _, err = ctl("alice", "key", "revoke", str(key.pk))
    assert code == 0, err
    assert GatewayKey.objects.get(pk=key.pk).revoked_by == users["alice"]


def test_a_member_may_not_revoke_a_teammates_key(
    ctl: Ctl, users: dict[str, Any], research: Team
) -> None:
    key, _ = key_create(actor=Actor.for_user(users["alice"], "cli"), name="alices-app")
    code, _, err = ctl("bob", "key", "revoke", str(key.pk))
    assert code == 1
    assert err == (
        "error: Managing the keys of team research needs the team admin role in it (you are a "
        "member); ask a team admin or an administrator.\n"
    )
    assert GatewayKey.objects.get(pk=key.pk).revoked_at is None
