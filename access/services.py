"""Writes for gateway keys and teams: create, limits, revoke, members, and the record of a key's use.

The API, the CLI (through the API), the admin and the console all call these,
so they cannot disagree about who may do what. Who may set what:

- any user creates keys of their own (a viewer in no team makes none), and sets
  their own keys' limits, team and expiry; staff do the same for everyone's keys,
  and a team admin for the keys in their team (never moving them out of it);
- only staff add and remove teams, set a team's limits, give the team admin role,
  and set key policies (each limit's default and ceiling for the keys of a team,
  of a user, or of everyone else); staff and the team's team admins set its members;
- what staff set on a key, and its policy's ceilings, are ceilings: an owner may
  lower what they use, never raise or lift it past what staff gave, nor take a
  key out of the teams that hold it. access.policies.judge decides, for every
  door. A key's limits are also at most its team's, and a user puts a key only
  into a team they are a member of.

access.roles says who holds which role, and what each role may do (its table of actions).

Every change of a key's limits, of a team and of a key policy is in the audit, with who made it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone
from rest_framework import serializers

from catalog import services as catalog_services
from catalog.config import current_config
from catalog.definitions import MAX_NAME, NAME_PATTERN, validate_name
from catalog.models import AuditEntry
from catalog.services import audit_entry, record_change, record_event
from core.actor import Actor, require_staff
from core.durations import DurationError, parse_duration
from core.refusals import Problem, Refused, conflict, forbidden, invalid
from llmgw.bearer import GATEWAY_KEY
from llmgw.limitdefs import LIMITS

from . import live, policies, roles
from .models import (
    ADMIN,
    HAND,
    MEMBER,
    ROLES,
    TEAM_ADMIN,
    VIEWER,
    GatewayKey,
    GroupMapping,
    KeyPolicy,
    Team,
    TeamRole,
    UserWeight,
    hash_key,
)
from .policies import COUNTERS

# A key's look (llmgw.bearer.GATEWAY_KEY): its fixed prefix, and what is kept of it in clear,
# to tell keys apart in listings: the prefix and six of its 43 random characters (36 of 256
# random bits; the other 220 are still far beyond guessing).
KEY_PREFIX = GATEWAY_KEY.prefix
SHOWN_CHARS = GATEWAY_KEY.shown
KEY_NAME_MAX = 100


# -- limits: one reading of what each door was given -------------------------------------

# What key_set_limits and team_set_limits take; a name missing from a change is left as it is.
KEY_SETTINGS = [*COUNTERS, "models", "weight", "team", "expires"]
TEAM_SETTINGS = [*COUNTERS, "models", "weight"]
# The database holds a signed 64-bit integer.
MAX_COUNTER = 2**63 - 1
MAX_WEIGHT = 1000.0
MAX_MODEL_PATTERNS = 100
# A model's or adapter's name, with fnmatch's *, ? and [...] among its characters.
MODEL_PATTERN = re.compile(r"^[A-Za-z0-9._:*?\[\]!-]+$")
# What Django's username validator allows.
USERNAME = re.compile(r"^[\w.@+-]{1,150}$")
# Words that lift a limit, as the CLI and forms write them.
NO_LIMIT = ("", "none", "0")
WHOLE = re.compile(r"[0-9]{1,19}")


def _counter(name: str, raw: Any, problems: list[Problem]) -> int | None:
    """A counter as any door gives it: a whole number; 0, none or nothing lifts the limit."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in NO_LIMIT):
        return None
    # ASCII digits only, and no more than a 64-bit integer has: int() takes "²" for a digit,
    # and refuses more than 4,300 digits with an error of its own.
    if isinstance(raw, str) and WHOLE.fullmatch(raw.strip()):
        raw = int(raw.strip())
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0 or raw > MAX_COUNTER:
        problems.append(
            Problem(
                name, f"is a whole number from 1 up, or 0 or none for no limit, not {_shown(raw)}"
            )
        )
        return None
    return raw or None


def _shown(raw: Any) -> str:
    """What was given, short enough for a refusal's sentence."""
    text = repr(raw)
    return text if len(text) <= 40 else f"{text[:30]}…({len(text)} characters)"


def _model_patterns(raw: Any, problems: list[Problem]) -> list[str]:
    """Names or fnmatch globs of models and adapters; [] (or none) is every model."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in NO_LIMIT):
        return []
    if isinstance(raw, str):
        raw = raw.split(",")
    if not isinstance(raw, list | tuple):
        problems.append(Problem("models", "is a list of model names or globs, like llama-*"))
        return []
    patterns: list[str] = []
    for item in raw:
        pattern = item.strip() if isinstance(item, str) else item
        if not isinstance(pattern, str) or not pattern:
            problems.append(Problem("models", "holds names or globs, not empty entries"))
        elif len(pattern) > MAX_NAME or not MODEL_PATTERN.fullmatch(pattern):
            problems.append(
                Problem(
                    "models",
                    f"{pattern[:40]!r} is not a model name or glob: use a model's or adapter's "
                    "name, with * for any characters (like llama-* or *:support)",
                )
            )
        elif pattern not in patterns:
            patterns.append(pattern)
    if len(patterns) > MAX_MODEL_PATTERNS:
        problems.append(Problem("models", f"holds at most {MAX_MODEL_PATTERNS} names or globs"))
    return patterns


def _weight(raw: Any, problems: list[Problem]) -> float:
    try:
        weight = float(raw)
    except (TypeError, ValueError):
        weight = float("nan")
    if isinstance(raw, bool) or not (0 < weight <= MAX_WEIGHT):
        problems.append(
            Problem("weight", f"is a number above 0 and at most {MAX_WEIGHT:g}, not {_shown(raw)}")
        )
        return 1.0
    return weight


def parse_expiry(raw: Any, *, now: datetime | None = None) -> datetime | None:
    """When a key stops working: a duration from now (30d, 12h), a date (00:00 UTC that day) or
    a date and time; none (or nothing) for never. Raises ValueError saying what was wrong."""
    now = now or timezone.now()
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "never", "0")):
        return None
    when: datetime | None = None
    if isinstance(raw, datetime):
        when = raw
    elif isinstance(raw, date):
        when = datetime(raw.year, raw.month, raw.day)
    elif isinstance(raw, str):
        text = raw.strip()
        try:
            seconds = parse_duration(text)
        except DurationError:
            seconds = None
        if seconds:
            return now + timedelta(seconds=seconds)
        try:
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            when = None
    if when is None:
        raise ValueError(
            f"{str(raw)[:40]!r} is not an expiry: give a duration from now like 30d or 12h, "
            "a date like 2027-01-31 (00:00 UTC that day) or a date and time in ISO 8601, "
            "or none for never"
        )
    when = when.replace(tzinfo=UTC) if timezone.is_naive(when) else when.astimezone(UTC)
    if when <= now:
        raise ValueError(
            f"{when:%Y-%m-%d %H:%M} UTC is already past: give a time to come, or a duration "
            "like 30d"
        )
    return when


def _expiry(raw: Any, problems: list[Problem]) -> datetime | None:
    try:
        return parse_expiry(raw)
    except ValueError as refusal:
        problems.append(Problem("expires", str(refusal)))
        return None


def _read_settings(changes: Mapping[str, Any], allowed: list[str], what: str) -> dict[str, Any]:
    """The settings a change gives, read as their fields hold them; refuses all of it at once."""
    problems = [
        Problem(name, f"is not a setting here; the settings are {', '.join(allowed)}")
        for name in changes
        if name not in allowed
    ]
    wanted: dict[str, Any] = {}
    for name, raw in changes.items():
        if name in COUNTERS:
            wanted[name] = _counter(name, raw, problems)
        elif name == "models":
            wanted[name] = _model_patterns(raw, problems)
        elif name == "weight":
            wanted[name] = _weight(raw, problems)
        elif name == "expires":
            wanted["expires_at"] = _expiry(raw, problems)
        elif name == "team":
            wanted[name] = raw.strip() if isinstance(raw, str) else raw
    if problems:
        raise invalid(problems, what=what)
    return wanted


def limits_of(holder: GatewayKey | Team) -> dict[str, Any]:
    """A key's or team's limits as every door shows them (None: no limit)."""
    return {
        **{name: getattr(holder, name) for name in COUNTERS},
        "models": list(holder.models),
        "weight": holder.weight,
    }


# A key's or team's use now, each against the limit beside it (access.live.use_now).
LIVE_FIGURES = {limit.name: limit.used for limit in LIMITS if not limit.budget}


def live_usage(
    *, keys: Iterable[GatewayKey] = (), teams: Iterable[Team] = ()
) -> dict[tuple[str, int], dict[str, int | None]]:
    """What each key and team uses now, by ("key", id) and ("team", id): requests and tokens in
    the last minute and requests in flight, over this machine's gateway processes, in one read
    of their files for them all (a page or a listing calls this once, not once a row).

    Why None rather than 0 for a key or team without any of COUNTERS: the gateway counts only
    limited keys and teams (an unlimited key costs nothing), so it holds no figure for them,
    and a 0 would say that a key serving many requests is idle."""
    keys, teams = list(keys), list(teams)
    found = live.use_now(keys=keys, teams=teams)
    usage: dict[tuple[str, int], dict[str, int | None]] = {}
    for kind, holders in (("key", keys), ("team", teams)):
        for holder in holders:
            use = found[(kind, holder.pk)]
            counted = any(getattr(holder, name) is not None for name in COUNTERS)
            usage[(kind, holder.pk)] = {
                figure: getattr(use, figure) if counted else None
                for figure in LIVE_FIGURES.values()
            }
    return usage


def _key_record(key: GatewayKey) -> dict[str, Any]:
    """What the audit keeps of a key's settings."""
    return {
        "name": key.name,
        "owner": key.owner.get_username(),
        "team": key.team.name if key.team else None,
        "expires_at": key.expires_at.isoformat() if key.expires_at else None,
        **limits_of(key),
        "ceilings": dict(key.ceilings or {}),
    }


# The audit's subject column (AuditEntry.model_name) names what changed. With a space, which no
# model's name holds, a key's or team's entries cannot be taken for a model's.
KEY_SUBJECT = "key #"
TEAM_SUBJECT = "team "


def _key_subject(key: GatewayKey) -> str:
    return f"{KEY_SUBJECT}{key.pk}"


def _team_subject(name: str) -> str:
    return f"{TEAM_SUBJECT}{name}"[:100]  # the audit's subject column holds 100 characters


# -- keys -------------------------------------------------------------------------------


def key_create(
    *,
    actor: Actor,
    name: str,
    team: str | None = None,
    models: Any = None,
    limits: Mapping[str, Any] | None = None,
    expires: Any = None,
    weight: Any = None,
) -> tuple[GatewayKey, str]:
    """A new key owned by the actor; returns it and the key itself, which is shown only this once.

    `limits` holds any of COUNTERS; `team`, `models`, `expires` and `weight` as key_set_limits
    takes them. Without a team, a member's key goes into their team with limits; the limits not
    given are its key policy's defaults. Nothing is made when any of them is refused."""
    if actor.user is None:
        raise forbidden("Only a user can own a gateway key; log in first.")
    roles.require(actor, "keys.make")
    name = (name or "").strip()
    if not name or len(name) > KEY_NAME_MAX:
        raise Refused(
            f"Give the key a name of 1 to {KEY_NAME_MAX} characters that says what it is for "
            "(say, the application that will use it).",
            code="invalid",
        )
    changes: dict[str, Any] = dict(limits or {})
    given = {"team": team, "models": models, "expires": expires, "weight": weight}
    changes.update({k: v for k, v in given.items() if v is not None})
    wanted = _read_settings(changes, KEY_SETTINGS, what="The key")
    secret = GATEWAY_KEY.new()
    with transaction.atomic():
        # The owner's row is locked while the keys are counted, so two creates at once
        # cannot both see room for one more.
        get_user_model().objects.select_for_update().filter(pk=actor.user.pk).first()
        refuse_past_key_limit(actor.user)
        key = GatewayKey(
            name=name,
            owner=actor.user,
            prefix=GATEWAY_KEY.shown_part(secret),
            key_hash=hash_key(secret),
        )
        _apply_key_settings(actor, key, wanted, what="The key", new=True)
        key.save()
        record_change(actor, _key_subject(key), "key-create", None, _key_record(key))
    return key, secret


def refuse_past_key_limit(user: Any) -> None:
    """Every gateway process holds every active key in memory: one user's keys are bounded."""
    limit = settings.LLMGW_MAX_KEYS_PER_USER
    active = GatewayKey.objects.filter(owner=user, revoked_at__isnull=True).count()
    if active >= limit:
        raise conflict(
            f"You have {active} active gateway {'key' if active == 1 else 'keys'}, and one user "
            f"may hold at most {limit}. "
            "Revoke the keys you no longer use (`llmgw ctl keys` lists them, "
            "`llmgw ctl key revoke ID` revokes one), or ask the operator to raise "
            "LLMGW_MAX_KEYS_PER_USER.",
            code="too_many_keys",
        )


def key_revoke(*, actor: Actor, key_id: int) -> GatewayKey:
    """Revoke a key (its owner or staff); requests with it are refused from now on.

    Revoking a revoked key changes nothing and is not an error: the caller wanted
    the key not to work, and it does not.
    """
    with transaction.atomic():
        key = _key_for_change(actor, key_id)
        if key.revoked_at is None:
            key.revoked_at = timezone.now()
            key.revoked_by = actor.user
            key.save(update_fields=["revoked_at", "revoked_by"])
            record_event(actor, _key_subject(key), "key-revoke", f"{key.prefix}… ({key.name})")
    return key


def key_set_limits(*, actor: Actor, key_id: int, changes: Mapping[str, Any]) -> GatewayKey:
    """Change a key's limits, models, weight, team or expiry (its owner or staff).

    `changes` holds any of KEY_SETTINGS; what it does not name stays. A counter of 0 or none
    lifts that limit, models [] allows every model, a team of none takes the key out of its
    team, expires none makes it never expire, each as access.policies.judge allows (an owner
    stays within the ceilings and their teams). All or nothing: one refused setting changes
    none."""
    wanted = _read_settings(changes, KEY_SETTINGS, what="The change")
    with transaction.atomic():
        key = _key_for_change(actor, key_id)
        if "team" in wanted and not _owns(actor, key):
            # A team admin manages the keys in their team; where a key is, staff decide.
            roles.require(actor, "key.move-others")
        before = _key_record(key)
        _apply_key_settings(actor, key, wanted, what="The change")
        after = _key_record(key)
        if after != before:
            key.save()
            record_change(actor, _key_subject(key), "key-limits", before, after)
    return key


def _apply_key_settings(
    actor: Actor, key: GatewayKey, wanted: dict[str, Any], *, what: str, new: bool = False
) -> None:
    """Set what `wanted` holds on the key, as access.policies.judge allows (see the module's
    rules). A new key goes into its maker's team when they name none, and gets its policy's
    defaults for the limits not given. What staff set becomes the key's ceilings."""
    touched = set(wanted)
    for name, value in wanted.items():
        if name == "team":
            key.team = _team_for_key(actor, key, value)
        else:
            setattr(key, name, value)
    if new:
        if "team" not in touched:
            key.team = policies.team_for_new_key(actor, key.owner)
        defaults = policies.defaults_of(policies.policy_for(key.team, key.owner))
        for name, figure in defaults.items():
            if name not in touched:
                setattr(key, name, figure)
    refusal = policies.judge(actor, key, touched, new=new).refusal(what)
    if refusal is not None:
        raise refusal
    if policies.may_raise(actor):
        policies.record_ceilings(key, touched)


def _team_for_key(actor: Actor, key: GatewayKey, name: Any) -> Team | None:
    if name is None or (isinstance(name, str) and name.lower() in ("", "none")):
        return None
    team = Team.objects.filter(name=name).first() if could_be_team(name) else None
    owner = key.owner if key.owner_id else actor.user
    if team is None or (not actor.is_staff and not team.members.filter(pk=owner.pk).exists()):
        # As with keys, a team one is not in is reported as missing.
        raise Refused(
            f"There is no team {str(name)[:100]!r} that {owner.get_username()} is a member of; "
            "`llmgw ctl teams` lists yours, and staff add members.",
            code="not_found",
            status=404,
        )
    return team


def _owns(actor: Actor, key: GatewayKey) -> bool:
    return actor.is_staff or key.owner_id == getattr(actor.user, "pk", None)


def _key_for_change(actor: Actor, key_id: int) -> GatewayKey:
    """The key `actor` changes: theirs, one in a team they are a team admin of, or (staff) any.
    A teammate's key is refused naming the role it needs."""
    key = (
        GatewayKey.objects.select_for_update(of=("self",))
        .select_related("owner", "team")
        .filter(pk=key_id)
        .first()
    )
    if key is not None and _owns(actor, key):
        return key
    if key is not None and key.team is not None:
        if roles.may(actor, "team.keys", team=key.team):
            return key
        if roles.role_in(actor, key.team) == MEMBER:
            raise roles.refusal(actor, "team.keys", team=key.team)
    # Someone else's key is reported as missing, not forbidden, so that key ids
    # do not tell outsiders which keys exist.
    raise Refused(
        f"There is no gateway key {key_id} of yours; `llmgw ctl keys` lists them.",
        code="not_found",
        status=404,
    )


# -- teams ------------------------------------------------------------------------------


def _team_record(team: Team) -> dict[str, Any]:
    return {"name": team.name, **limits_of(team)}


def could_be_team(name: object) -> bool:
    """Whether `name` could name a team at all. Anything else is not looked up: text a database
    cannot hold (a NUL) would fail the query instead of finding nothing."""
    return isinstance(name, str) and len(name) <= MAX_NAME and bool(NAME_PATTERN.fullmatch(name))


def _team_named(name: str, *, lock: bool = False) -> Team:
    teams = Team.objects.select_for_update() if lock else Team.objects.all()
    team = teams.filter(name=name).first() if could_be_team(name) else None
    if team is None:
        raise Refused(
            f"There is no team named {str(name)[:100]!r}; `llmgw ctl teams` lists them.",
            code="not_found",
            status=404,
        )
    return team


def _team_seen(actor: Actor, name: str, *, lock: bool = False) -> Team:
    """The team named, if `actor` may see it: a team one is not in is reported as missing."""
    team = _team_named(name, lock=lock)
    if not roles.may(actor, "team.read", team=team):
        raise Refused(
            f"There is no team named {name[:100]!r} of yours; `llmgw ctl teams` lists them.",
            code="not_found",
            status=404,
        )
    return team


def _team_name(name: Any) -> str:
    """A team's name follows the catalog's name rules: it is part of URLs and commands."""
    name = name.strip() if isinstance(name, str) else ""
    try:
        if not name:
            raise serializers.ValidationError("give the team a name, like research or support")
        validate_name(name)
    except serializers.ValidationError as refusal:
        detail = refusal.detail if isinstance(refusal.detail, list) else [refusal.detail]
        raise invalid([Problem("name", str(d)) for d in detail], what="The team") from None
    return name


def team_add(
    *,
    actor: Actor,
    name: str,
    limits: Mapping[str, Any] | None = None,
    members: Iterable[str] = (),
) -> Team:
    """A new team (staff), with its limits (any of TEAM_SETTINGS) and first members."""
    roles.require(actor, "team.add")
    name = _team_name(name)
    wanted = _read_settings(dict(limits or {}), TEAM_SETTINGS, what="The team")
    with transaction.atomic():
        if Team.objects.filter(name=name).exists():
            raise conflict(
                f"There is already a team named {name!r}; `llmgw ctl team limits {name}` "
                "changes its limits.",
                code="exists",
            )
        team = Team(name=name, **wanted)
        try:
            with transaction.atomic():
                team.save()
        except IntegrityError:  # the same name added at the same moment
            raise conflict(f"There is already a team named {name!r}.", code="exists") from None
        added = _users_named(list(members))
        team.members.add(*added)
        record_change(
            actor,
            _team_subject(name),
            "team-add",
            None,
            {**_team_record(team), "members": sorted(u.get_username() for u in added)},
        )
    return team


def team_set_limits(*, actor: Actor, name: str, changes: Mapping[str, Any]) -> Team:
    """Change a team's limits (staff). Its keys' own limits stay as they are: each request is
    held to the key's and the team's, whichever is lower."""
    roles.require(actor, "team.limits")
    wanted = _read_settings(changes, TEAM_SETTINGS, what="The change")
    with transaction.atomic():
        team = _team_named(name, lock=True)
        before = _team_record(team)
        for field, value in wanted.items():
            setattr(team, field, value)
        after = _team_record(team)
        if after != before:
            team.save()
            record_change(actor, _team_subject(team.name), "team-limits", before, after)
    return team


def team_members(
    *,
    actor: Actor,
    name: str,
    add: Iterable[str] = (),
    remove: Iterable[str] = (),
    add_admins: Iterable[str] = (),
    remove_admins: Iterable[str] = (),
) -> Team:
    """Add and remove a team's members (staff, and the team's team admins), and give or take
    away the team admin role (staff; a team admin is made a member too). A member removed keeps
    their keys in the team (still held to its limits) until the key's owner or staff moves them,
    and loses their roles in it; a team admin removes members, not other team admins."""
    add, remove = list(add), list(remove)
    add_admins, remove_admins = list(add_admins), list(remove_admins)
    problems = [
        Problem(field, f"{', '.join(both)} is both {words}; say which")
        for field, both, words in [
            ("members", sorted(set(add) & set(remove)), "added and removed"),
            ("admins", sorted(set(add_admins) & set(remove_admins)), "made and unmade team admin"),
            ("members", sorted(set(add_admins) & set(remove)), "made team admin and removed"),
        ]
        if both
    ]
    if problems:
        raise invalid(problems, what="The change")
    with transaction.atomic():
        team = _team_seen(actor, name, lock=True)
        roles.require(actor, "team.members", team=team)
        if add_admins or remove_admins:
            roles.require(actor, "team.admins")
        joining, leaving = _users_named([*add, *add_admins]), _users_named(remove)
        made = _users_named(add_admins, field="admins")
        unmade = _users_named(remove_admins, field="admins")
        admins_before = roles.admins_of(team)
        if not actor.is_staff and set(admins_before) & {u.get_username() for u in leaving}:
            roles.require(actor, "team.remove-admin")
        before = sorted(team.members.values_list("username", flat=True))
        team.members.add(*joining)
        team.members.remove(*leaving)
        # Their roles in the team go with their membership (the group mapping's marks too).
        TeamRole.objects.filter(team=team, user__in=leaving).delete()
        TeamRole.objects.filter(team=team, role=TEAM_ADMIN, user__in=unmade).delete()
        for user in made:
            # Given by hand: the group mapping no longer takes it away.
            TeamRole.objects.update_or_create(
                user=user, role=TEAM_ADMIN, team=team, defaults={"source": HAND}
            )
        after = sorted(team.members.values_list("username", flat=True))
        if after != before:
            record_change(
                actor,
                _team_subject(team.name),
                "team-members",
                {"members": before},
                {"members": after},
            )
        admins_after = roles.admins_of(team)
        if admins_after != admins_before:
            record_change(
                actor,
                _team_subject(team.name),
                "team-admins",
                {"admins": admins_before},
                {"admins": admins_after},
            )
    return team


def team_remove(*, actor: Actor, name: str) -> int:
    """Remove a team (staff); its keys stay, without a team's limits. Returns how many keys."""
    roles.require(actor, "team.remove")
    with transaction.atomic():
        team = _team_named(name, lock=True)
        keys = team.keys.count()
        record_change(
            actor,
            _team_subject(team.name),
            "team-remove",
            _team_record(team),
            None,
            note=f"{keys} key(s) left without a team",
        )
        team.delete()
    return keys


# -- key policies ------------------------------------------------------------------------

POLICY_PARTS = ("defaults", "ceilings")
# Keys lowered to a new ceiling are written and audited this many at a time.
LOWER_CHUNK = 500


def _policy_subject(scope: str) -> str:
    return f"key policy {scope}"[:100]  # the audit's subject column holds 100 characters


def _policy_record(policy: KeyPolicy) -> dict[str, Any]:
    return {"scope": policy.scope, "defaults": policy.defaults, "ceilings": policy.ceilings}


def policy_scope(scope: Any) -> tuple[str, Team | None, Any]:
    """A policy's scope as the API and CLI name it (default, team:NAME, user:NAME): its kind,
    team and user. A team or user that does not exist is a 404, as the scope's own mistakes are."""
    text = scope.strip() if isinstance(scope, str) else ""
    kind, _, name = text.partition(":")
    if text == "default":
        return "default", None, None
    if kind == "team" and name:
        return "team", _team_named(name), None
    if kind == "user" and name:
        user = (
            get_user_model().objects.filter(username=name).first()
            if USERNAME.fullmatch(name)
            else None
        )
        if user is None:
            raise Refused(
                f"There is no user named {name[:150]!r}; a user's key policy names an account "
                "that exists (user:NAME).",
                code="not_found",
                status=404,
            )
        return "user", None, user
    raise Refused(
        f"{text[:100]!r} is not a key policy: name one as default (every user's keys in no "
        "team), team:NAME or user:NAME.",
        code="not_found",
        status=404,
    )


def _policy_figures(part: str, raw: Any, problems: list[Problem]) -> dict[str, int | None]:
    """One part of a policy change, a limit's name to its figure (None: take it away)."""
    if not isinstance(raw, Mapping):
        problems.append(
            Problem(part, f'is an object of limits, like {{"rpm": 60}}, not {_shown(raw)}')
        )
        return {}
    figures: dict[str, int | None] = {}
    for name, figure in raw.items():
        if name not in COUNTERS:
            problems.append(
                Problem(
                    f"{part}.{str(name)[:40]}",
                    f"is not a limit; the limits are {', '.join(COUNTERS)}",
                )
            )
            continue
        figures[name] = _counter(f"{part}.{name}", figure, problems)
    return figures


def policy_set(
    *,
    actor: Actor,
    scope: str,
    defaults: Mapping[str, Any] | None = None,
    ceilings: Mapping[str, Any] | None = None,
) -> tuple[KeyPolicy, int]:
    """Set a key policy's defaults and ceilings (staff), making the policy when there is none.

    A limit a change does not name stays; 0 or none takes its default or ceiling away. The keys
    under the policy that are above a ceiling now (or without that limit) are lowered to it, each
    in the audit: a ceiling holds for every key under it, not only the next ones. Staff's own keys,
    and a limit staff set on a key itself, are left as they are. Returns the policy and how many
    keys were lowered."""
    roles.require(actor, "policies.set")
    kind, team, user = policy_scope(scope)
    problems: list[Problem] = []
    given = {"defaults": defaults, "ceilings": ceilings}
    wanted = {
        part: _policy_figures(part, raw, problems) for part, raw in given.items() if raw is not None
    }
    if problems:
        raise invalid(problems, what="The policy")
    with transaction.atomic():
        policy = (
            KeyPolicy.objects.select_for_update().filter(kind=kind, team=team, user=user).first()
        )
        before = _policy_record(policy) if policy is not None else None
        if policy is None:
            policy = KeyPolicy(kind=kind, team=team, user=user)
        for part, figures in wanted.items():
            merged = dict(getattr(policy, part))
            for name, figure in figures.items():
                if figure is None:
                    merged.pop(name, None)
                else:
                    merged[name] = figure
            setattr(policy, part, {name: merged[name] for name in COUNTERS if name in merged})
        for name in COUNTERS:
            default, ceiling = policy.defaults.get(name), policy.ceilings.get(name)
            if default is not None and ceiling is not None and default > ceiling:
                problems.append(
                    Problem(
                        f"defaults.{name}",
                        f"{default:,} is above its ceiling of {ceiling:,}; a new key's default is "
                        "at most the ceiling",
                    )
                )
        if problems:
            raise invalid(problems, what="The policy")
        after = _policy_record(policy)
        if after == before:
            return policy, 0
        try:
            with transaction.atomic():
                policy.save()
        except IntegrityError:  # the same policy made at the same moment
            raise conflict(
                f"The key policy {policy.scope} was just made by someone else; look at it "
                "(`llmgw ctl key policy SCOPE`) and set it again.",
                code="exists",
            ) from None
        lowered = _lower_keys_to(actor, policy)
        note = f"{lowered} key(s) lowered to its ceilings" if lowered else ""
        record_change(actor, _policy_subject(policy.scope), "key-policy", before, after, note=note)
    return policy, lowered


def policy_remove(*, actor: Actor, scope: str) -> KeyPolicy:
    """Remove a key policy (staff). The keys under it keep their limits; their owners are held to
    the next policy in line (a user's, then the default) from their next change."""
    roles.require(actor, "policies.remove")
    kind, team, user = policy_scope(scope)
    with transaction.atomic():
        policy = (
            KeyPolicy.objects.select_for_update().filter(kind=kind, team=team, user=user).first()
        )
        if policy is None:
            raise Refused(
                f"There is no key policy {scope[:100]}; `llmgw ctl key policies` lists them.",
                code="not_found",
                status=404,
            )
        record_change(
            actor,
            _policy_subject(policy.scope),
            "key-policy-remove",
            _policy_record(policy),
            None,
            note="its keys keep their limits",
        )
        policy.delete()
    return policy


def keys_under(policy: KeyPolicy) -> Any:
    """The active keys a policy holds whose owners are not staff (staff raise their own)."""
    keys = GatewayKey.objects.filter(revoked_at__isnull=True, owner__is_staff=False)
    if policy.kind == "team":
        return keys.filter(team=policy.team)
    # Keys in no team, or in a team without a policy of its own (no team has none either).
    outside = keys.filter(team__key_policy__isnull=True)
    if policy.kind == "user":
        return outside.filter(owner=policy.user)
    return outside.filter(owner__llmgw_key_policy__isnull=True)


def _lower_keys_to(actor: Actor, policy: KeyPolicy) -> int:
    """Lower the keys under `policy` to its ceilings, where staff set nothing on the key itself;
    returns how many. Keys are locked and written a chunk at a time, each in the audit."""
    over = Q()
    for name, ceiling in policy.ceilings.items():
        over |= (Q(**{f"{name}__isnull": True}) | Q(**{f"{name}__gt": ceiling})) & ~Q(
            ceilings__has_key=name
        )
    if not over:
        return 0
    keys = keys_under(policy).filter(over).select_related("owner", "team").order_by("pk")
    note = f"lowered to the ceilings of {policies.policy_words(policy)}"
    lowered, after_id = 0, 0
    while True:
        chunk = list(keys.select_for_update(of=("self",)).filter(pk__gt=after_id)[:LOWER_CHUNK])
        if not chunk:
            return lowered
        entries = []
        # Each key lowered is lowered to the ceiling itself: one UPDATE a limit, not one a key.
        lower: dict[str, list[int]] = {name: [] for name in policy.ceilings}
        for key in chunk:
            before = _key_record(key)
            for name, ceiling in policy.ceilings.items():
                figure = getattr(key, name)
                if name not in key.ceilings and (figure is None or figure > ceiling):
                    setattr(key, name, ceiling)
                    lower[name].append(key.pk)
            entries.append(
                audit_entry(
                    actor,
                    _key_subject(key),
                    "key-limits",
                    note,
                    before=before,
                    after=_key_record(key),
                )
            )
        for name, ids in lower.items():
            if ids:
                GatewayKey.objects.filter(pk__in=ids).update(**{name: policy.ceilings[name]})
        AuditEntry.objects.bulk_create(entries)
        lowered += len(chunk)
        after_id = chunk[-1].pk


# -- roles given by hand, and the group mapping's rows ----------------------------------------


def role_give(*, actor: Actor, username: str, role: str, team: str | None = None) -> TeamRole:
    """Give `username` a role by hand (staff): team-admin of `team` (which makes them a member,
    as team_members does), or viewer (no team). Given by hand, the group mapping leaves it."""
    roles.require(actor, "roles.give")
    if role == TEAM_ADMIN:
        if not team:
            raise invalid(
                [Problem("team", "a team admin's role is in a team: say which team")],
                what="The role",
            )
        found = team_members(actor=actor, name=team, add_admins=[username])
        return TeamRole.objects.get(user__username=username, role=TEAM_ADMIN, team=found)
    _refuse_role(role, team, given=(VIEWER,))
    with transaction.atomic():
        (user,) = _users_named([username], field="user")
        row = TeamRole.objects.filter(user=user, role=role, team=None).first()
        if row is not None and row.source == HAND:
            return row
        row, _ = TeamRole.objects.update_or_create(
            user=user, role=role, team=None, defaults={"source": HAND}
        )
        record_event(
            actor, f"{USER_SUBJECT}{username}"[:100], "role-add", f"{username} is a {role}"
        )
    return row


def role_take(*, actor: Actor, username: str, role: str, team: str | None = None) -> None:
    """Take a role away (staff), whoever gave it: the group mapping gives it again at the next
    sign-in if the person's groups still say so."""
    roles.require(actor, "roles.give")
    if role == TEAM_ADMIN:
        team_members(actor=actor, name=team or "", remove_admins=[username])
        return
    _refuse_role(role, team, given=(VIEWER,))
    with transaction.atomic():
        (user,) = _users_named([username], field="user")
        gone, _ = TeamRole.objects.filter(user=user, role=role, team=None).delete()
        if gone:
            record_event(
                actor,
                f"{USER_SUBJECT}{username}"[:100],
                "role-remove",
                f"{username} is no longer a {role}",
            )


def _refuse_role(role: str, team: str | None, *, given: tuple[str, ...]) -> None:
    """A role by hand is team-admin in a team or one of `given` in none; member is Team.members
    and admin is staff, each set where they are (team members, the user's staff flag)."""
    if role in given and not team:
        return
    if role in given:
        message = f"{role} is a role over everything: give no team"
    elif role == MEMBER:
        message = "a member is given by adding them to the team (team members)"
    elif role == ADMIN:
        message = "an admin is a staff user: set their staff status"
    else:
        message = f"is not a role; the roles are {', '.join(r for r, _ in ROLES)}"
    raise invalid([Problem("role", message)], what="The role")


GROUP_SUBJECT = "group mapping "


def group_mapping_add(*, actor: Actor, group: str, role: str, team: str | None = None) -> Any:
    """Map one of the identity provider's groups to a role (staff), beside the setting
    LLMGW_OIDC_GROUP_MAP; it applies from each person's next sign-in (access.roles)."""
    roles.require(actor, "roles.give")
    text = f"{group}={role}:{team}" if team else f"{group}={role}"
    try:
        (grant,) = roles.parse_group_map(text)
    except (ImproperlyConfigured, ValueError) as error:
        raise invalid([Problem("group", str(error))], what="The mapping") from None
    with transaction.atomic():
        found = _team_named(grant.team) if grant.team else None
        row, made = GroupMapping.objects.get_or_create(
            group=grant.group, role=grant.role, team=found
        )
        if made:
            record_event(actor, f"{GROUP_SUBJECT}{grant.group}"[:100], "group-mapping-add", text)
    return row


def group_mapping_remove(*, actor: Actor, mapping_id: int) -> None:
    """Remove a group's mapping row (staff); from the next sign-in, it gives nothing."""
    roles.require(actor, "roles.give")
    with transaction.atomic():
        row = GroupMapping.objects.select_related("team").filter(pk=mapping_id).first()
        if row is None:
            return
        record_event(actor, f"{GROUP_SUBJECT}{row.group}"[:100], "group-mapping-remove", str(row))
        row.delete()


# -- people's weights in the fair queue ------------------------------------------------------

USER_SUBJECT = "user "


def user_weight_set(*, actor: Actor, username: str, weight: Any) -> UserWeight | None:
    """Set a person's weight in the fair queue (staff), or, with None, go back to none (1 in a
    team; their heaviest key's outside one): gateway.fairqueue.share says how it counts."""
    require_staff(actor, "set a person's weight in the fair queue")
    problems: list[Problem] = []
    wanted = None if weight is None else _weight(weight, problems)
    if not isinstance(username, str) or not username.strip():
        problems.append(Problem("user", "names the person whose weight this is; it is empty"))
    if problems:
        raise invalid(problems, what="The change")
    with transaction.atomic():
        (user,) = _users_named([username], field="user")
        row = UserWeight.objects.select_for_update().filter(user=user).first()
        before = None if row is None else {"weight": row.weight}
        if wanted is None:
            if row is not None:
                row.delete()
            row = None
        elif row is None:
            row = UserWeight.objects.create(user=user, weight=wanted)
        elif row.weight != wanted:
            row.weight = wanted
            row.save(update_fields=["weight"])
        after = None if row is None else {"weight": row.weight}
        if after != before:
            subject = f"{USER_SUBJECT}{user.get_username()}"[:100]
            record_change(actor, subject, "user-weight", before, after)
    return row


def user_weights(*, actor: Actor) -> list[tuple[str, float]]:
    """The people staff gave a weight, with it, by name: everyone's for staff, one's own else."""
    rows = UserWeight.objects.select_related("user").order_by("user__username")
    if not actor.is_staff:
        rows = rows.filter(user=actor.user)
    return [(row.user.get_username(), row.weight) for row in rows]


def _users_named(names: list[str], *, field: str = "members") -> list[Any]:
    names = [n.strip() for n in names if isinstance(n, str) and n.strip()]
    # Only names a user could have are looked up (see could_be_team); the rest are missing.
    possible = [n for n in names if USERNAME.fullmatch(n)]
    found = list(get_user_model().objects.filter(username__in=possible))
    missing = sorted(set(names) - {u.get_username() for u in found})
    if missing:
        raise invalid(
            [Problem(field, f"there is no user named {n[:150]!r}") for n in missing],
            what="The change",
        )
    return found


def keys_used(key_ids: list[int]) -> None:
    """Record that these keys were just used (the gateway batches this, see gateway.state)."""
    GatewayKey.objects.filter(pk__in=key_ids).update(last_used_at=timezone.now())


# -- the idle clock -----------------------------------------------------------------------

# An on-demand model is stopped once nobody has asked for it for its idle timeout.
# Every request counts as asking, but writing that down on every request would
# make the database the gateway's bottleneck: each process writes it at most
# this often per model (and a quarter of the idle timeout when that is shorter,
# so that a short timeout still sees several refreshes before it runs out).
DEMAND_REFRESH_SECONDS = 5.0
# With nothing ready, the write also wakes the reconciler, so it is made sooner.
DEMAND_WAKE_SECONDS = 1.0


def demand_every(idle_timeout: float | None, *, nothing_ready: bool) -> float:
    """Seconds between two writes of one model's idle clock by one gateway process."""
    idle = idle_timeout or current_config().default_idle_timeout
    return DEMAND_WAKE_SECONDS if nothing_ready else min(DEMAND_REFRESH_SECONDS, idle / 4)


def model_asked_for(model: str) -> bool:
    """Restart an on-demand model's idle clock (and load it when nothing runs); False when the
    model is gone. The gateway's state decides how often (demand_every)."""
    try:
        catalog_services.model_demand(name=model)
    except Refused:
        return False  # removed since the catalog was read: the request gets its 404 next time
    return True
