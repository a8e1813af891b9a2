"""Who may set a key's limits to what: ceilings, key policies, and the teams a key stays in.

What staff set on a key is a ceiling: its owner may lower that setting, never raise or lift it.
A key policy (access.models.KeyPolicy: a team's, a user's, or the default) gives each limit of
the keys under it a default and a ceiling; the ceiling in force is what staff set on the key
itself, else its policy's. judge() is the one place that decides whether a change of a key is
allowed: access.services calls it for every door (API, CLI, console, admin), so that they cannot
disagree. The rules as people meet them: docs/sharing.md#who-may-set-what.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any

from django.db.models import Q

from core.actor import Actor
from core.refusals import Problem, Refused, invalid
from llmgw import limitdefs

from .models import GatewayKey, KeyPolicy, Team

# The counters of access.models.LimitFields, in the order every door shows them.
COUNTERS = list(limitdefs.COUNTERS)
# What a ceiling on a key may hold: the counters, the weight, the models and the expiry.
KEY_CEILINGS = [*COUNTERS, "weight", "models", "expires_at"]
# Who raises a ceiling, as the refusals say it.
WHO_RAISES = "staff"
DEFAULT_WEIGHT = 1.0
# fnmatch's special characters: a pattern with none of them names one model.
GLOB = frozenset("*?[")


def may_raise(actor: Actor) -> bool:
    """Whether `actor` sets ceilings (and so is held to none): staff and the installation."""
    return actor.is_staff or actor.is_installation


# -- which policy and which teams ------------------------------------------------------------


def policy_for(team: Team | None, owner: Any) -> KeyPolicy | None:
    """The policy a key of `owner` in `team` is under: its team's, else its owner's, else the
    default (None: there is none)."""
    team_ids = [team.pk] if team is not None else []
    found = _policies(team_ids, [owner.pk])
    return _pick(found, team.pk if team is not None else None, owner.pk)


def policies_for(keys: list[GatewayKey]) -> dict[int, KeyPolicy | None]:
    """The policy of each key, by its id, read in one query for them all."""
    team_ids = sorted({k.team_id for k in keys if k.team_id is not None})
    found = _policies(team_ids, sorted({k.owner_id for k in keys}))
    return {k.pk: _pick(found, k.team_id, k.owner_id) for k in keys}


# Ids asked about in one query: SQLite takes at most 32,766 parameters (older builds 999), and
# staff may list every key there is.
IDS_CHUNK = 500


def _policies(team_ids: list[int], user_ids: list[int]) -> dict[tuple[str, int | None], KeyPolicy]:
    policies = KeyPolicy.objects.select_related("team", "user")
    rows = list(policies.filter(kind="default"))
    for start in range(0, max(len(team_ids), len(user_ids)), IDS_CHUNK):
        teams, users = team_ids[start : start + IDS_CHUNK], user_ids[start : start + IDS_CHUNK]
        rows += policies.filter(
            Q(kind="team", team_id__in=teams) | Q(kind="user", user_id__in=users)
        )
    return {(p.kind, p.team_id if p.kind == "team" else p.user_id): p for p in rows}


def _pick(
    found: dict[tuple[str, int | None], KeyPolicy], team_id: int | None, owner_id: int
) -> KeyPolicy | None:
    if team_id is not None and ("team", team_id) in found:
        return found[("team", team_id)]
    return found.get(("user", owner_id)) or found.get(("default", None))


def team_binds(team: Team) -> bool:
    """Whether a team holds its members' keys: it has a limit (a counter or models) or a key
    policy. A team of neither counts nothing, so a key in it or out of it uses the same."""
    limited = any(getattr(team, name) is not None for name in COUNTERS) or bool(team.models)
    return limited or hasattr(team, "key_policy")


def binding_teams(user: Any) -> list[Team]:
    """The teams `user` is a member of that bind their keys, by name."""
    teams = Team.objects.filter(members=user).select_related("key_policy").order_by("name")
    return [team for team in teams if team_binds(team)]


def team_for_new_key(actor: Actor, owner: Any) -> Team | None:
    """The team a new key goes into when its maker names none: their one binding team. With
    several, they say which (a 400); staff and a user in no binding team get none."""
    if may_raise(actor):
        return None
    teams = binding_teams(owner)
    if len(teams) > 1:
        names = ", ".join(t.name for t in teams)
        raise invalid(
            [
                Problem(
                    "team",
                    f"you are a member of {names}, whose limits hold your keys: say which team "
                    f"the key is in (like team {teams[0].name})",
                )
            ],
            what="The key",
        )
    return teams[0] if teams else None


def defaults_of(policy: KeyPolicy | None) -> dict[str, int]:
    """What a new key gets of each limit it was not given: the policy's default, else its
    ceiling (a key under a ceiling is never without that limit)."""
    if policy is None:
        return {}
    found = {name: policy.ceilings.get(name) for name in COUNTERS}
    found.update({name: policy.defaults.get(name) for name in COUNTERS if name in policy.defaults})
    return {name: figure for name, figure in found.items() if figure is not None}


def policy_words(policy: KeyPolicy) -> str:
    """A policy as a sentence names it."""
    if policy.team is not None:
        return f"the team {policy.team.name}'s key policy"
    if policy.user is not None:
        return f"{policy.user.get_username()}'s key policy"
    return "the default key policy"


# -- ceilings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ceiling:
    """The most a key's owner may set one setting to, and who set it (completing "that …")."""

    figure: Any
    source: str


def ceilings_in_force(key: GatewayKey, policy: KeyPolicy | None) -> dict[str, Ceiling]:
    """Each setting's ceiling for the key's owner: what staff set on the key, else its policy's."""
    found: dict[str, Ceiling] = {}
    if policy is not None:
        sets = f"{policy_words(policy)} sets"
        for name in COUNTERS:
            if policy.ceilings.get(name) is not None:
                found[name] = Ceiling(policy.ceilings[name], sets)
    for name, figure in (key.ceilings or {}).items():
        if name in KEY_CEILINGS:
            found[name] = Ceiling(figure, f"{WHO_RAISES} set on this key")
    return found


def ceilings_view(key: GatewayKey, policy: KeyPolicy | None) -> dict[str, Any]:
    """A key's ceilings as every door shows them: each of KEY_CEILINGS, None where there is
    none (the weight's is its team's or 1 then, as rule 4 says)."""
    found = ceilings_in_force(key, policy)
    view: dict[str, Any] = {
        name: found[name].figure if name in found else None for name in COUNTERS
    }
    view["weight"] = found["weight"].figure if "weight" in found else _team_weight(key)
    view["models"] = found["models"].figure if "models" in found else []
    view["expires_at"] = found["expires_at"].figure if "expires_at" in found else None
    return view


def record_ceilings(key: GatewayKey, names: set[str]) -> None:
    """What staff just set on the key becomes its ceilings; what they lifted (a counter to none,
    the models to every model, the expiry to never) leaves that setting to its policy's."""
    ceilings = dict(key.ceilings or {})
    for name in KEY_CEILINGS:
        if name not in names:
            continue
        value = getattr(key, name)
        if value is None or value == []:
            ceilings.pop(name, None)
        elif name == "expires_at":
            ceilings[name] = value.isoformat()
        else:
            ceilings[name] = value
    key.ceilings = ceilings


# -- the judge --------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What judge() found wrong with a change: nothing, or problems that refuse all of it."""

    problems: list[Problem] = field(default_factory=list)
    # Whether one of them is of authority (rules 1 and 3: 403) rather than of figures (400).
    forbidden: bool = False

    def refuse(self, problem: Problem, *, forbidden: bool) -> None:
        self.problems.append(problem)
        self.forbidden = self.forbidden or forbidden

    def refusal(self, what: str) -> Refused | None:
        if not self.problems:
            return None
        refused = invalid(self.problems, what=what)
        if self.forbidden:
            return dataclasses.replace(refused, code="above_ceiling", status=403)
        return refused


def judge(actor: Actor, key: GatewayKey, touched: set[str], *, new: bool = False) -> Verdict:
    """Whether `actor` may give `key` the settings it now holds (changed in memory, not saved).

    `touched` names the settings the change gives (KEY_SETTINGS' names, the expiry as
    expires_at); `new` is a key being made, whose every limit is held to its ceilings. Only what
    a change touches is held to the rules (every limit when the key changes team): a key above
    a figure lowered since (its team's) can still have its other settings changed.

    The rules, in the order applied:

    1. The team (403). A member of a team that binds (one with limits or a key policy) keeps
       their keys in such a team: a new key goes into one, and a key moves only to another.
       Why: a team's limits count its keys together, and a key taken out counted against none
       of them; budgets bound only those who kept their keys in.
    2. The team's figures (400). A key's limit is at most its team's: a higher one would never
       take effect, and says what is not so.
    3. The ceilings (403). Each limit the change sets (every limit when the key moves team, and
       so policy) is set and at most its ceiling; a model list is within the one staff gave; an
       expiry is no later than the one staff set. Why 403: the figure is fine, the one asking
       may not set it; the sentence says who may.
    4. The weight (400): a key's share is at most what staff gave the key, else its team's,
       else 1.

    Staff, and the installation itself, are held only to rule 2: they set the ceilings
    (record_ceilings)."""
    verdict = Verdict()
    moved = new or "team" in touched
    owner_bound = not may_raise(actor)
    team = key.team
    # 1. The team.
    if owner_bound and moved:
        _judge_team(key, verdict)
    # 2. The team's figures: on a move every limit, else those given.
    figures = [c for c in COUNTERS if c in touched or (moved and not new)]
    for name in figures:
        mine, theirs = getattr(key, name), getattr(team, name, None)
        # A key without a figure of its own is held to the team's: that is not above it.
        if theirs is not None and mine is not None and mine > theirs:
            verdict.refuse(
                Problem(
                    name,
                    f"{mine:,} is above the team {team}'s {theirs:,}; a key's limit is at most "
                    f"its team's (ask {WHO_RAISES} to raise the team's)",
                ),
                forbidden=False,
            )
    if not owner_bound:
        return verdict
    # 3. The ceilings.
    ceilings = ceilings_in_force(key, policy_for(team, key.owner))
    for name in COUNTERS:
        if (moved or name in touched) and name in ceilings:
            _judge_counter(name, getattr(key, name), ceilings[name], verdict)
    if "models" in touched and "models" in ceilings:
        _judge_models(key.models, ceilings["models"], verdict)
    if "expires_at" in touched and "expires_at" in ceilings:
        _judge_expiry(key.expires_at, ceilings["expires_at"], verdict)
    # 4. The weight.
    if moved or "weight" in touched:
        if "weight" in ceilings:
            ceiling, whose = float(ceilings["weight"].figure), f"the {WHO_RAISES}-given"
        else:
            ceiling = _team_weight(key)
            whose = f"the team {team}'s" if team is not None else "the default"
        if key.weight > ceiling:
            verdict.refuse(
                Problem(
                    "weight",
                    f"{key.weight:g} is above {whose} {ceiling:g}; only {WHO_RAISES} give a key "
                    "a larger share",
                ),
                forbidden=False,
            )
    return verdict


def _team_weight(key: GatewayKey) -> float:
    return key.team.weight if key.team is not None else DEFAULT_WEIGHT


def _judge_team(key: GatewayKey, verdict: Verdict) -> None:
    teams = binding_teams(key.owner)
    if not teams or key.team in teams:
        return
    names = ", ".join(t.name for t in teams)
    where = "no team" if key.team is None else f"the team {key.team.name}, which holds no limits,"
    verdict.refuse(
        Problem(
            "team",
            f"{where} is not one of your teams with limits ({names}): a key of yours stays in "
            f"one of them, and only {WHO_RAISES} put a key elsewhere (ask an administrator)",
        ),
        forbidden=True,
    )


def _judge_counter(name: str, value: int | None, ceiling: Ceiling, verdict: Verdict) -> None:
    if value is not None and value <= ceiling.figure:
        return
    shown = "none (no limit)" if value is None else f"{value:,}"
    verdict.refuse(
        Problem(
            name,
            f"{shown} is above the ceiling of {ceiling.figure:,} that {ceiling.source}; you may "
            f"lower it, and only {WHO_RAISES} raise or lift it (ask an administrator)",
        ),
        forbidden=True,
    )


def within(patterns: list[str], allowed: list[str]) -> bool:
    """Whether every model `patterns` lets a key use is one `allowed` lets it use: each pattern
    is one of the allowed, or a plain name one of them matches. (Whether one glob is inside
    another is not worked out: such a pattern is refused, and naming the models passes.)"""
    if not patterns:
        return not allowed
    return all(
        p in allowed or (not GLOB & set(p) and any(fnmatchcase(p, a) for a in allowed))
        for p in patterns
    )


def _judge_models(models: list[str], ceiling: Ceiling, verdict: Verdict) -> None:
    if within(models, ceiling.figure):
        return
    shown = ", ".join(models) if models else "every model"
    verdict.refuse(
        Problem(
            "models",
            f"{shown} is wider than the models {ceiling.source} ({', '.join(ceiling.figure)}); "
            f"you may narrow them, and only {WHO_RAISES} widen them (ask an administrator)",
        ),
        forbidden=True,
    )


def _judge_expiry(expires_at: datetime | None, ceiling: Ceiling, verdict: Verdict) -> None:
    latest = datetime.fromisoformat(ceiling.figure)
    if expires_at is not None and expires_at <= latest:
        return
    shown = "never" if expires_at is None else f"{expires_at:%Y-%m-%d %H:%M} UTC"
    verdict.refuse(
        Problem(
            "expires",
            f"{shown} is later than the expiry of {latest:%Y-%m-%d %H:%M} UTC that "
            f"{ceiling.source}; you may bring it earlier, and only {WHO_RAISES} extend it "
            "(ask an administrator)",
        ),
        forbidden=True,
    )
