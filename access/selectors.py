"""Reads of gateway keys, teams and their usage, shaped for the API, the console and the CLI."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, date, datetime
from typing import Any

from django.db.models import Count, F, Prefetch, Q, QuerySet, Sum
from django.utils import timezone

from core.actor import Actor
from core.metrics import ControlPlaneFigures
from fleet.models import Node
from registry.models import Rollout

from . import policies, roles
from .models import TEAM_ADMIN, GatewayKey, KeyPolicy, KeyUsageDay, Team, TeamRole
from .services import could_be_team, limits_of


def keys_visible_to(actor: Actor) -> QuerySet[GatewayKey]:
    """A user sees their own keys, and a team admin the keys in their teams; staff see everyone's
    (access.roles: team.keys)."""
    keys = GatewayKey.objects.select_related("owner", "revoked_by", "team").order_by(
        "-created_at", "-id"
    )
    if actor.is_staff:
        return keys
    return keys.filter(
        Q(owner=actor.user) | Q(team_id__in=roles.teams_where(actor.user, "team.keys"))
    )


def key_view(key: GatewayKey, usage: dict[str, int], policy: KeyPolicy | None) -> dict[str, Any]:
    """A key as every door shows it: `usage` as usage_now gives it, `policy` as policies_for."""
    return {
        "id": key.pk,
        "name": key.name,
        "prefix": key.prefix,
        "owner": key.owner.get_username(),
        "state": key.state(),
        "created_at": key.created_at.isoformat(),
        "last_used_at": key.last_used_at.isoformat() if key.last_used_at else None,
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
        "revoked_by": key.revoked_by.get_username() if key.revoked_by else None,
        "team": key.team.name if key.team else None,
        "expires_at": key.expires_at.isoformat() if key.expires_at else None,
        "expired": bool(key.expires_at and key.expires_at <= timezone.now()),
        "limits": limits_of(key),
        "usage": usage,
        "ceilings": policies.ceilings_view(key, policy),
        "policy": policy.scope if policy is not None else None,
    }


def key_views(keys: Iterable[GatewayKey]) -> list[dict[str, Any]]:
    """Many keys, their usage and their policies each read in one query."""
    keys = list(keys)
    usage = usage_now([k.pk for k in keys])
    held = policies.policies_for(keys)
    return [key_view(k, usage[k.pk], held[k.pk]) for k in keys]


def _today() -> date:
    return datetime.now(UTC).date()


def usage_now(key_ids: list[int]) -> dict[int, dict[str, int]]:
    """What each key used today and this month (UTC), as the traffic book has written it (every
    few seconds): the figures the daily and monthly token budgets count. Per-minute figures are
    not kept per key, so rpm and tpm have none here."""
    return _usage_by("key_id", key_ids)


USAGE_FIGURES = ("requests_today", "tokens_today", "tokens_this_month")


# Ids asked about in one query: SQLite takes at most 32,766 parameters (older builds 999), and
# staff may list every key there is.
USAGE_CHUNK = 500


def _usage_by(group: str, ids: list[int]) -> dict[int, dict[str, int]]:
    today = _today()
    tokens = F("prompt_tokens") + F("completion_tokens")
    usage = {one: dict.fromkeys(USAGE_FIGURES, 0) for one in ids}
    for start in range(0, len(ids), USAGE_CHUNK):
        rows = (
            KeyUsageDay.objects.filter(
                **{f"{group}__in": ids[start : start + USAGE_CHUNK]},
                day__gte=today.replace(day=1),
            )
            .values(group)
            .annotate(
                requests_today=Sum("requests", filter=Q(day=today)),
                tokens_today=Sum(tokens, filter=Q(day=today)),
                tokens_this_month=Sum(tokens),
            )
            .order_by()
        )
        for row in rows:
            figures: dict[str, Any] = dict(row)
            usage[figures[group]] = {name: figures[name] or 0 for name in USAGE_FIGURES}
    return usage


# -- teams ------------------------------------------------------------------------------


def teams_visible_to(actor: Actor) -> QuerySet[Team]:
    """Staff and viewers see every team; a user sees the teams they are a member of."""
    teams = (
        Team.objects.prefetch_related("members", _ADMIN_ROLES)
        .select_related("key_policy")
        .annotate(key_count=Count("keys", filter=Q(keys__revoked_at__isnull=True)))
        .order_by("name")
    )
    if roles.may(actor, "teams.read-all"):
        return teams
    return teams.filter(members=actor.user)


# A team's team admins, read with the teams (team_view shows them).
_ADMIN_ROLES = Prefetch(
    "roles",
    queryset=TeamRole.objects.filter(role=TEAM_ADMIN).select_related("user"),
    to_attr="admin_roles",
)


def _admins(team: Team) -> list[str]:
    found = getattr(team, "admin_roles", None)
    if found is None:
        return roles.admins_of(team)
    return sorted(row.user.get_username() for row in found)


def team_visible_to(actor: Actor, name: str) -> Team | None:
    if not could_be_team(name):
        return None
    return teams_visible_to(actor).filter(name=name).first()


def team_view(team: Team, usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A team as every door shows it: its limits, members, active keys and their usage together."""
    if usage is None:
        usage = team_usage([team.pk])[team.pk]
    keys = getattr(team, "key_count", None)
    if keys is None:
        keys = team.keys.filter(revoked_at__isnull=True).count()
    return {
        "name": team.name,
        "members": sorted(u.get_username() for u in team.members.all()),
        "admins": _admins(team),
        "keys": keys,
        "created_at": team.created_at.isoformat(),
        "limits": limits_of(team),
        "usage": usage,
        "policy": policy_figures(getattr(team, "key_policy", None)),
    }


def team_views(teams: Iterable[Team]) -> list[dict[str, Any]]:
    teams = list(teams)
    usage = team_usage([t.pk for t in teams])
    return [team_view(t, usage[t.pk]) for t in teams]


def team_usage(team_ids: list[int]) -> dict[int, dict[str, int]]:
    """What each team's keys (revoked ones too: what they used still counts) used together."""
    return _usage_by("key__team_id", team_ids)


# -- key policies -----------------------------------------------------------------------


def policy_figures(policy: KeyPolicy | None) -> dict[str, dict[str, int | None]] | None:
    """A policy's defaults and ceilings, each limit named (None: none); None without a policy."""
    if policy is None:
        return None
    return {
        part: {name: getattr(policy, part).get(name) for name in policies.COUNTERS}
        for part in ("defaults", "ceilings")
    }


def policy_view(policy: KeyPolicy) -> dict[str, Any]:
    figures = policy_figures(policy)
    assert figures is not None
    return {"scope": policy.scope, **figures, "changed_at": policy.changed_at.isoformat()}


def policies_visible_to(actor: Actor) -> list[KeyPolicy]:
    """Staff see every key policy; a user, those that may hold their keys (the default, their
    own, their teams'). The default first, then teams' and users' by name."""
    found = KeyPolicy.objects.select_related("team", "user")
    if not actor.is_staff:
        found = found.filter(
            Q(kind="default") | Q(user=actor.user) | Q(team__members=actor.user)
        ).distinct()
    order = {"default": 0, "team": 1, "user": 2}
    return sorted(found, key=lambda p: (order[p.kind], p.scope))


def key_usage(
    actor: Actor,
    *,
    key_id: int | None = None,
    model: str | None = None,
    since: date | None = None,
) -> list[dict[str, Any]]:
    """Requests and tokens per day, key and model, newest day first: of `actor`'s own keys and
    their teams' where they are team admin; staff's and viewers', of everyone's (access.roles)."""
    if roles.may(actor, "usage.read-all"):
        keys = GatewayKey.objects.all()
    else:
        keys = GatewayKey.objects.filter(
            Q(owner=actor.user) | Q(team_id__in=roles.teams_where(actor.user, "team.usage"))
        )
    rows = (
        KeyUsageDay.objects.filter(key__in=keys.order_by())
        .values("day", "key_id", "key__name", "key__prefix", "key__owner__username", "model")
        .annotate(
            requests_sum=Sum("requests"),
            prompt_sum=Sum("prompt_tokens"),
            completion_sum=Sum("completion_tokens"),
        )
        .order_by("-day", "key_id", "model")
    )
    if key_id is not None:
        rows = rows.filter(key_id=key_id)
    if model:
        rows = rows.filter(model=model)
    if since is not None:
        rows = rows.filter(day__gte=since)
    return [
        {
            "day": row["day"].isoformat(),
            "key": row["key_id"],
            "key_name": row["key__name"],
            "key_prefix": row["key__prefix"],
            "owner": row["key__owner__username"],
            "model": row["model"],
            "requests": row["requests_sum"],
            "prompt_tokens": row["prompt_sum"],
            "completion_tokens": row["completion_sum"],
        }
        for row in rows
    ]


def control_plane_figures(now: datetime | None = None) -> ControlPlaneFigures:
    """What /metrics shows of the control plane's state, read at the scrape: rollouts by state
    (every state, 0 when none) and each node's seconds since its last heartbeat (None: never)."""
    now = now or timezone.now()
    rollouts = dict.fromkeys((state for state, _ in Rollout.STATES), 0)
    for state, count in Rollout.objects.values_list("state").annotate(n=Count("pk")).order_by():
        rollouts[state] = count
    ages = {
        name: None if heard is None else max(0.0, (now - heard).total_seconds())
        for name, heard in Node.objects.order_by("name").values_list("name", "last_heartbeat")
    }
    return ControlPlaneFigures(rollouts=rollouts, heartbeat_ages=ages)
