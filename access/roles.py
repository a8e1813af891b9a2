"""Roles: what each person may do, asked by every door (console, admin, API, CLI) through
access.services and access.selectors, and the identity provider's groups mapped onto them.

The four roles, as people meet them (docs/sharing.md#roles):

- admin: staff (User.is_staff), over everything;
- team admin: manages their team's members, keys and limits of keys (within what staff set),
  and sees its usage; an extra role on top of membership (TeamRole rows);
- member: a member of a team (Team.members), and any signed-in user in no team: makes keys
  under their policy and sees their own usage;
- viewer: reads models and usage (everyone's), makes no keys (a TeamRole row without a team).

A user without any role row does what they did before roles: a plain user is a member, staff
are admins. Only a row changes that: a viewer in no team makes no keys, a team admin gains
powers over their team.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import QuerySet
from rest_framework import serializers

from catalog.definitions import validate_name
from catalog.services import record_event
from core.actor import Actor
from core.refusals import Refused, forbidden

from .models import ADMIN, GROUPS, MEMBER, TEAM_ADMIN, VIEWER, GroupMapping, Team, TeamRole

# From most to least: the role a refusal says someone has is the first of theirs here.
RANKED = (ADMIN, TEAM_ADMIN, MEMBER, VIEWER)
ROLE_WORDS = {
    ADMIN: "the admin role",
    TEAM_ADMIN: "the team admin role",
    MEMBER: "the member role",
    VIEWER: "the viewer role",
}
HAVE_WORDS = {
    ADMIN: "an admin",
    TEAM_ADMIN: "a team admin",
    MEMBER: "a member",
    VIEWER: "a viewer",
}


@dataclass(frozen=True)
class Action:
    """What one action needs: the roles that may do it, and its words in a refusal. `words`
    starts the sentence ("Managing the keys of team {team}"); for an action only admins do, it
    completes "Only staff may …", as every staff-only refusal of the project says it."""

    roles: frozenset[str]
    words: str
    in_team: bool = False


def _action(words: str, *roles: str, in_team: bool = False) -> Action:
    return Action(frozenset({ADMIN, *roles}), words, in_team)


# The one table of who may do what. Admins (staff, and the installation itself) may do all.
ACTIONS: dict[str, Action] = {
    "keys.make": _action("Making gateway keys", TEAM_ADMIN, MEMBER),
    "usage.read-all": _action("Reading everyone's usage", VIEWER),
    "teams.read-all": _action("Reading every team", VIEWER),
    "team.read": _action("Reading team {team}", TEAM_ADMIN, MEMBER, VIEWER, in_team=True),
    "team.members": _action("Changing the members of team {team}", TEAM_ADMIN, in_team=True),
    "team.keys": _action("Managing the keys of team {team}", TEAM_ADMIN, in_team=True),
    "team.usage": _action("Reading the usage of team {team}'s keys", TEAM_ADMIN, in_team=True),
    "team.add": _action("add teams"),
    "team.limits": _action("set a team's limits"),
    "team.remove": _action("remove teams"),
    "team.admins": _action("give or take away the team admin role"),
    "team.remove-admin": _action("remove a team admin from a team"),
    "key.move-others": _action("move another person's key into or out of a team"),
    "roles.give": _action("give or take away roles and map the provider's groups"),
    "policies.set": _action("set key policies"),
    "policies.remove": _action("remove key policies"),
}


# -- what someone is ---------------------------------------------------------------------------


def roles_of(actor: Actor, team: Team | None = None) -> set[str]:
    """The roles `actor` holds in `team` (None: outside any one team)."""
    if actor.is_installation or actor.is_staff:
        return {ADMIN}
    user = actor.user
    if user is None:
        return set()
    rows = set(TeamRole.objects.filter(user=user).values_list("role", "team_id"))
    viewer = (VIEWER, None) in rows
    found = {VIEWER} if viewer else set()
    if team is not None:
        if (TEAM_ADMIN, team.pk) in rows:
            found.add(TEAM_ADMIN)
        if team.members.filter(pk=user.pk).exists():
            found.add(MEMBER)
        return found
    # Outside a team, every user is a member as before roles, unless marked viewer and in no
    # team: that is what a viewer is.
    if not viewer or Team.objects.filter(members=user).exists():
        found.add(MEMBER)
    return found


def role_in(actor: Actor, team: Team | None = None) -> str | None:
    """The highest role `actor` holds in `team`, as a refusal names it (None: none)."""
    held = roles_of(actor, team)
    return next((role for role in RANKED if role in held), None)


def may(actor: Actor, action: str, *, team: Team | None = None) -> bool:
    """Whether `actor` may do `action` (a name of ACTIONS), in `team` where it is a team's."""
    wanted = ACTIONS[action]
    if wanted.in_team and team is None:
        raise ValueError(f"{action} is asked about a team; pass team=")
    return bool(roles_of(actor, team if wanted.in_team else None) & wanted.roles)


def require(actor: Actor, action: str, *, team: Team | None = None) -> None:
    """Refuse (403) unless `actor` may do `action`; the refusal names the role it needs and the
    one they have: "Managing the keys of team research needs the team admin role in it (you are
    a member); ask a team admin or an administrator." """
    if may(actor, action, team=team):
        return
    raise refusal(actor, action, team=team)


def refusal(actor: Actor, action: str, *, team: Team | None = None) -> Refused:
    """The 403 that require() raises: the least role that may do `action`, and the most that
    `actor` holds. An action only admins do keeps the words of every staff-only refusal."""
    wanted = ACTIONS[action]
    if wanted.roles == {ADMIN}:
        return forbidden(f"Only staff may {wanted.words}; ask an administrator.")
    needed = next(role for role in reversed(RANKED) if role in wanted.roles)
    held = role_in(actor, team if wanted.in_team else None)
    words = wanted.words.format(team=team.name if team is not None else "")
    if wanted.in_team:
        you = f"you are {HAVE_WORDS[held]}" if held else "you have no role in it"
        return forbidden(
            f"{words} needs {ROLE_WORDS[needed]} in it ({you}); ask a team admin or an "
            "administrator."
        )
    you = f"you are {HAVE_WORDS[held]}" if held else "you have no role"
    return forbidden(f"{words} needs {ROLE_WORDS[needed]} ({you}); ask an administrator.")


def teams_where(user: Any, action: str) -> QuerySet[TeamRole, Any]:
    """The ids of the teams where `user` may do `action` by a role row of theirs (team admin),
    as a subquery (values of team_id): what a listing of many teams' rows filters by."""
    held = ACTIONS[action].roles & {TEAM_ADMIN}
    return TeamRole.objects.filter(user=user, role__in=held).values("team_id")


def admins_of(team: Team) -> list[str]:
    """The usernames of a team's team admins, by name."""
    return sorted(
        TeamRole.objects.filter(team=team, role=TEAM_ADMIN).values_list("user__username", flat=True)
    )


# -- the group mapping ------------------------------------------------------------------------

SETTING = "LLMGW_OIDC_GROUP_MAP"
MAPPED_ROLES = {
    "admin": ADMIN,
    "team-admin": TEAM_ADMIN,
    "member": MEMBER,
    "viewer": VIEWER,
}
# A group's name as a provider sends it: anything but the mapping's own separators.
GROUP = re.compile(r"^[^=,\s][^=,]*$")


@dataclass(frozen=True)
class Grant:
    """What one group gives: a role, in a team for member and team admin."""

    group: str
    role: str
    team: str | None = None


def parse_group_map(text: str) -> list[Grant]:
    """LLMGW_OIDC_GROUP_MAP read strictly: "group=role[:team]" entries, comma-separated, like
    "llm-admins=admin, research=member:research, research-leads=team-admin:research,
    auditors=viewer". Raises ImproperlyConfigured naming the first entry that is wrong."""
    grants: list[Grant] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        group, sign, given = (part.strip() for part in entry.partition("="))
        role, _, team = (part.strip() for part in given.partition(":"))
        problem = ""
        if not sign or not group or not GROUP.fullmatch(group):
            problem = "write each entry as group=role or group=role:team"
        elif role not in MAPPED_ROLES:
            problem = f"{role!r} is not a role; the roles are {', '.join(MAPPED_ROLES)}"
        elif MAPPED_ROLES[role] in (MEMBER, TEAM_ADMIN) and not team:
            problem = f"{role} is a role in a team: write {group}={role}:TEAM"
        elif MAPPED_ROLES[role] in (ADMIN, VIEWER) and ":" in given:
            problem = f"{role} is a role over everything, in no team: write {group}={role}"
        elif team:
            try:
                validate_name(team)
            except serializers.ValidationError as error:
                problem = f"the team {team!r}: " + " ".join(str(d) for d in error.detail)
        if problem:
            raise ImproperlyConfigured(f"{SETTING}: the entry {entry!r} is wrong: {problem}.")
        grants.append(Grant(group, MAPPED_ROLES[role], team or None))
    return grants


@lru_cache(maxsize=4)
def _parsed(text: str) -> tuple[Grant, ...]:
    return tuple(parse_group_map(text))


def group_map() -> list[Grant]:
    """The mapping in force: the setting's entries, then the admin's rows."""
    grants = list(_parsed(getattr(settings, SETTING, "") or ""))
    rows = GroupMapping.objects.select_related("team").order_by("group", "role", "pk")
    grants += [Grant(row.group, row.role, row.team.name if row.team else None) for row in rows]
    return grants


@checks.register()
def check_group_map(**kwargs: Any) -> list[checks.CheckMessage]:
    """A wrong LLMGW_OIDC_GROUP_MAP stops the start, naming its entry (manage.py check)."""
    try:
        _parsed(getattr(settings, SETTING, "") or "")
    except ImproperlyConfigured as error:
        return [checks.Error(str(error), id="access.E001")]
    return []


def _user_subject(user: Any) -> str:
    return f"user {user.get_username()}"[:100]


def _team_subject(name: str) -> str:
    return f"team {name}"[:100]


def apply_groups(user: Any, groups: Iterable[str], *, actor: Actor) -> None:
    """Make `user`'s roles and memberships that come from the mapping exactly what `groups` say
    now, at a sign-in: adds and takes away what the mapping gave (TeamRole rows of source
    "groups" mark it), and leaves what staff gave by hand. Teams the mapping names are made
    when absent. Every change is audited as `actor`.

    Refused (403) when the groups map to no role at all; what the mapping gave before is taken
    away first (committed), so that the person's API tokens hold no more than their groups say.
    The caller then refuses the sign-in."""
    groups = sorted({g.strip() for g in groups if isinstance(g, str) and g.strip()})
    grants = [g for g in group_map() if g.group in groups]
    with transaction.atomic():
        _apply(user, grants, actor)
    if not grants:
        shown = ", ".join(groups) or "none"
        raise Refused(
            f"{user.get_username()}'s groups ({shown}) map to no role in llmgw; ask an "
            f"administrator to add a mapping ({SETTING}).",
            code="no_role",
            status=403,
        )


def _apply(user: Any, grants: list[Grant], actor: Actor) -> None:
    # The user's row is locked: two sign-ins at once apply one after the other.
    type(user).objects.select_for_update().filter(pk=user.pk).first()
    user.refresh_from_db(fields=["is_staff", "is_superuser"])
    who = user.get_username()
    wanted_teams: dict[str, set[str]] = {MEMBER: set(), TEAM_ADMIN: set()}
    for grant in grants:
        if grant.team is not None:
            wanted_teams[grant.role].add(grant.team)
    # A team admin is a member as well.
    wanted_teams[MEMBER] |= wanted_teams[TEAM_ADMIN]
    teams = {name: _team_made(name, actor) for name in sorted(wanted_teams[MEMBER])}
    rows = {
        (row.role, row.team.name if row.team else None): row
        for row in TeamRole.objects.select_related("team").filter(user=user)
    }
    # admin: the staff flag; the mapping unsets only what it set (never a superuser's).
    _apply_flag(user, actor, any(g.role == ADMIN for g in grants), rows.get((ADMIN, None)))
    # viewer: a row without a team.
    want_viewer = any(g.role == VIEWER for g in grants)
    viewer = rows.get((VIEWER, None))
    if want_viewer and viewer is None:
        TeamRole.objects.create(user=user, role=VIEWER, source=GROUPS)
        record_event(actor, _user_subject(user), "role-add", f"{who} is a viewer (groups)")
    elif not want_viewer and viewer is not None and viewer.source == GROUPS:
        viewer.delete()
        record_event(actor, _user_subject(user), "role-remove", f"{who} is no longer a viewer")
    # member: Team.members, marked by a row where the mapping made the membership.
    member_of = set(Team.objects.filter(members=user).values_list("name", flat=True))
    for name, team in teams.items():
        if name not in member_of:
            team.members.add(user)
            TeamRole.objects.create(user=user, role=MEMBER, team=team, source=GROUPS)
            record_event(actor, _team_subject(name), "team-member-add", f"{who} (groups)")
    for (role, held), row in rows.items():
        if role == MEMBER and row.source == GROUPS and held not in teams:
            assert row.team is not None
            row.team.members.remove(user)
            row.delete()
            record_event(
                actor, _team_subject(row.team.name), "team-member-remove", f"{who} (groups)"
            )
    # team admin: a row in the team.
    for name in sorted(wanted_teams[TEAM_ADMIN]):
        if (TEAM_ADMIN, name) not in rows:
            TeamRole.objects.create(user=user, role=TEAM_ADMIN, team=teams[name], source=GROUPS)
            record_event(actor, _team_subject(name), "role-add", f"{who} is a team admin (groups)")
    for (role, held), row in rows.items():
        if role == TEAM_ADMIN and row.source == GROUPS and held not in wanted_teams[TEAM_ADMIN]:
            row.delete()
            record_event(
                actor, _team_subject(str(held)), "role-remove", f"{who} is no longer a team admin"
            )


def _apply_flag(user: Any, actor: Actor, wanted: bool, marker: TeamRole | None) -> None:
    who = user.get_username()
    if wanted and not user.is_staff:
        user.is_staff = True
        user.save(update_fields=["is_staff"])
        TeamRole.objects.get_or_create(
            user=user, role=ADMIN, team=None, defaults={"source": GROUPS}
        )
        record_event(actor, _user_subject(user), "role-add", f"{who} is an admin (staff; groups)")
    elif not wanted and marker is not None:
        marker.delete()
        if user.is_staff and not user.is_superuser:
            user.is_staff = False
            user.save(update_fields=["is_staff"])
            record_event(
                actor, _user_subject(user), "role-remove", f"{who} is no longer an admin (staff)"
            )


def _team_made(name: str, actor: Actor) -> Team:
    """The team the mapping names, made (and audited) when there is none."""
    team = Team.objects.filter(name=name).first()
    if team is not None:
        return team
    team, made = Team.objects.get_or_create(name=name)
    if made:
        record_event(actor, _team_subject(name), "team-add", "made by the group mapping", name=name)
    return team
