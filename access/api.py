"""Gateway keys, teams and key policies in the REST API under /api/v1/keys, /api/v1/teams and
/api/v1/key-policies, for `llmgw ctl`.

Any user (not a viewer) creates keys of their own and sees, limits and revokes
their own; a team admin those in their teams; staff everyone's. Staff add teams
and set their limits, members and team admins; a team admin sets their team's
members; a user sees the teams they are in (access.roles has the table). Staff set key policies; a user
sees those that may hold their keys. What staff set is a ceiling the owner may
lower and never raise (access.services and access.policies have the rules).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import actor_of, answers, out, validated
from core.refusals import Refused
from core.serializers import StrictSerializer
from llmgw.limitdefs import LIMITS, Limit

from . import selectors, services
from .models import GatewayKey, Team
from .services import KEY_NAME_MAX


def with_limits(make: Callable[[Limit], serializers.Field]) -> Callable[[type], type]:
    """A serializer class with one field per limit (llmgw.limitdefs.LIMITS) before its own."""

    def decorate(cls: type) -> type:
        cls._declared_fields = {  # type: ignore[attr-defined]
            **{limit.name: make(limit) for limit in LIMITS},
            **cls._declared_fields,  # type: ignore[attr-defined]
        }
        return cls

    return decorate


def _counter_field(limit: Limit) -> serializers.IntegerField:
    return serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=services.MAX_COUNTER,
        help_text=f"{limit.meaning}; 0 or null lifts the limit",
    )


@with_limits(lambda limit: serializers.IntegerField(allow_null=True, help_text=limit.meaning))
class LimitsOut(serializers.Serializer):
    models = serializers.ListField(
        child=serializers.CharField(), help_text="names or globs it may use; [] for every model"
    )
    weight = serializers.FloatField(help_text="its share of a model's slots when requests queue")


NOT_COUNTED = (
    "; null when it has no limit to count against (rpm, tpm, max_parallel or a token budget): "
    "the gateway counts only limited keys and teams"
)


class UsageOut(serializers.Serializer):
    requests_today = serializers.IntegerField(help_text="UTC day, as last written (seconds ago)")
    tokens_today = serializers.IntegerField(help_text="against tokens_per_day")
    tokens_this_month = serializers.IntegerField(help_text="against tokens_per_month")
    requests_last_minute = serializers.IntegerField(
        allow_null=True,
        help_text="against rpm: requests let through in the last 60 to 65 s, as this machine's "
        "gateway processes count them now" + NOT_COUNTED,
    )
    tokens_last_minute = serializers.IntegerField(
        allow_null=True,
        help_text="against tpm: tokens of the requests that ended in the last 60 to 65 s"
        + NOT_COUNTED,
    )
    in_flight = serializers.IntegerField(
        allow_null=True, help_text="against max_parallel: requests being answered now" + NOT_COUNTED
    )


@with_limits(lambda limit: serializers.IntegerField(allow_null=True, help_text="null: no ceiling"))
class CeilingsOut(serializers.Serializer):
    weight = serializers.FloatField(help_text="the largest share its owner may give it")
    models = serializers.ListField(
        child=serializers.CharField(), help_text="the widest models it may have; []: any"
    )
    expires_at = serializers.DateTimeField(
        allow_null=True, help_text="the latest expiry; null: any"
    )


class KeyOut(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    prefix = serializers.CharField(help_text="the key's first characters")
    owner = serializers.CharField()
    state = serializers.ChoiceField(choices=["active", "revoked"])
    created_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField(allow_null=True, help_text="to within a minute")
    revoked_at = serializers.DateTimeField(allow_null=True)
    revoked_by = serializers.CharField(allow_null=True)
    team = serializers.CharField(allow_null=True, help_text="whose limits it also counts against")
    expires_at = serializers.DateTimeField(allow_null=True, help_text="null: never")
    expired = serializers.BooleanField(help_text="past expires_at: it opens nothing")
    limits = LimitsOut()
    usage = UsageOut()
    ceilings = CeilingsOut(
        help_text="the most its owner may set each setting to: what staff set on the key, else "
        "its key policy's; staff are held to none"
    )
    policy = serializers.CharField(
        allow_null=True,
        help_text="the key policy it is under: team:NAME, user:NAME or default; null: none",
    )


class NewKeyOut(KeyOut):
    key = serializers.CharField(help_text="the key itself: shown only in this answer")


@with_limits(_counter_field)
class LimitsInput(StrictSerializer):
    """The settings a key and a team share; a field not sent is left as it is."""

    models = serializers.ListField(
        child=serializers.CharField(max_length=200),
        required=False,
        max_length=services.MAX_MODEL_PATTERNS,
        help_text="names or globs (llama-*) of the models and adapters it may use; [] for all",
    )
    weight = serializers.FloatField(
        required=False,
        help_text=f"its share when requests queue for a model's slots, above 0, at most "
        f"{services.MAX_WEIGHT:g}",
    )


class KeyLimitsInput(LimitsInput):
    team = serializers.CharField(
        required=False,
        allow_null=True,
        max_length=200,
        help_text="a team you are a member of; null or none takes the key out of its team",
    )
    expires = serializers.CharField(
        required=False,
        allow_null=True,
        max_length=100,
        help_text="a duration from now (30d), a date (00:00 UTC that day) or an ISO 8601 time; "
        "null or none: never",
    )


class KeyCreateInput(KeyLimitsInput):
    name = serializers.CharField(
        max_length=KEY_NAME_MAX,
        help_text="what the key is for, say the application using it",
        error_messages={
            "blank": "give the key a name that says what it is for, say the application using it"
        },
    )


def key_items(keys: Iterable[GatewayKey]) -> list[dict[str, Any]]:
    """Keys as KeyOut shows them, with their use today, this month and now (the gateway's files
    read once for them all)."""
    keys = list(keys)
    now = services.live_usage(keys=keys)
    return [
        {**view, "usage": {**view["usage"], **now[("key", key.pk)]}}
        for key, view in zip(keys, selectors.key_views(keys), strict=True)
    ]


def team_items(teams: Iterable[Team]) -> list[dict[str, Any]]:
    """Teams as TeamOut shows them, with their keys' use today, this month and now."""
    teams = list(teams)
    now = services.live_usage(teams=teams)
    return [
        {**view, "usage": {**view["usage"], **now[("team", team.pk)]}}
        for team, view in zip(teams, selectors.team_views(teams), strict=True)
    ]


class KeysAPI(APIView):
    @extend_schema(
        summary="Gateway keys: your own and, for a team admin, those in their teams (staff: "
        "everyone's)",
        responses=answers({200: KeyOut(many=True)}),
    )
    def get(self, request: Request) -> Response:
        keys = selectors.keys_visible_to(actor_of(request))
        return Response(out(KeyOut, key_items(keys), many=True))

    @extend_schema(
        summary="Create a gateway key for yourself; the answer holds the key, shown only once",
        request=KeyCreateInput,
        responses=answers({201: NewKeyOut}, 404, 409, body=True),
    )
    def post(self, request: Request) -> Response:
        data = validated(KeyCreateInput, request.data)
        name = data.pop("name")
        key, secret = services.key_create(actor=actor_of(request), name=name, limits=data)
        body = out(NewKeyOut, {**key_items([key])[0], "key": secret})
        return Response(body, status=status.HTTP_201_CREATED)


class KeyRevokeAPI(APIView):
    @extend_schema(
        summary="Revoke a gateway key (its owner, its team's team admins or staff); requests with "
        "it get 401 from now on",
        request=None,
        responses=answers({200: KeyOut}, 404),
    )
    def post(self, request: Request, key_id: int) -> Response:
        refuse_past_ids(key_id)
        key = services.key_revoke(actor=actor_of(request), key_id=key_id)
        return Response(out(KeyOut, key_items([key])[0]))


def refuse_past_ids(key_id: int) -> None:
    if key_id >= 2**62:  # no such key: a database integer could not even hold the id
        raise Refused(
            f"There is no gateway key {key_id} of yours; `llmgw ctl keys` lists them.",
            code="not_found",
            status=404,
        )


class KeyLimitsAPI(APIView):
    @extend_schema(
        summary="Change a key's limits, models, weight, team or expiry (its owner, its team's team "
        "admins or staff)",
        description="Fields not sent stay as they are. A key's limits are at most its team's.",
        request=KeyLimitsInput,
        responses=answers({200: KeyOut}, 404, body=True),
    )
    def patch(self, request: Request, key_id: int) -> Response:
        refuse_past_ids(key_id)
        changes = validated(KeyLimitsInput, request.data)
        key = services.key_set_limits(actor=actor_of(request), key_id=key_id, changes=changes)
        return Response(out(KeyOut, key_items([key])[0]))


# -- teams ----------------------------------------------------------------------------------


@with_limits(lambda limit: serializers.IntegerField(allow_null=True))
class PolicyFiguresOut(serializers.Serializer):
    """One figure per limit; null where it sets none."""


class TeamPolicyOut(serializers.Serializer):
    defaults = PolicyFiguresOut(help_text="what a member's new key gets of each limit not given")
    ceilings = PolicyFiguresOut(help_text="the most a member may set a key's limit to")


class TeamOut(serializers.Serializer):
    name = serializers.CharField()
    members = serializers.ListField(child=serializers.CharField(), help_text="usernames")
    admins = serializers.ListField(
        child=serializers.CharField(),
        help_text="the members who are its team admins: they change its members and manage its "
        "keys",
    )
    keys = serializers.IntegerField(help_text="active keys in the team")
    created_at = serializers.DateTimeField()
    limits = LimitsOut(help_text="over all the team's keys together")
    usage = UsageOut(help_text="all the team's keys together")
    policy = TeamPolicyOut(
        allow_null=True, help_text="its key policy, for each key in it; null: none"
    )


class TeamCreateInput(LimitsInput):
    name = serializers.CharField(max_length=200, help_text="the catalog's name rules")
    members = serializers.ListField(
        child=serializers.CharField(max_length=150), required=False, help_text="usernames"
    )


class TeamMembersInput(StrictSerializer):
    add = serializers.ListField(
        child=serializers.CharField(max_length=150), required=False, help_text="usernames"
    )
    remove = serializers.ListField(
        child=serializers.CharField(max_length=150), required=False, help_text="usernames"
    )
    add_admins = serializers.ListField(
        child=serializers.CharField(max_length=150),
        required=False,
        help_text="usernames to give the team admin role (staff); they become members too",
    )
    remove_admins = serializers.ListField(
        child=serializers.CharField(max_length=150),
        required=False,
        help_text="usernames whose team admin role is taken away (staff); they stay members",
    )


class TeamRemovedOut(serializers.Serializer):
    name = serializers.CharField()
    keys = serializers.IntegerField(help_text="its keys, which stay, without a team")


def _team_answer(request: Request, name: str) -> Any:
    team = selectors.team_visible_to(actor_of(request), name)
    if team is None:
        raise Refused(
            f"There is no team named {name[:100]!r} of yours; `llmgw ctl teams` lists them.",
            code="not_found",
            status=404,
        )
    return out(TeamOut, team_items([team])[0])


class TeamsAPI(APIView):
    @extend_schema(
        summary="Teams: yours (staff: every team), with their limits and usage",
        responses=answers({200: TeamOut(many=True)}),
    )
    def get(self, request: Request) -> Response:
        teams = selectors.teams_visible_to(actor_of(request))
        return Response(out(TeamOut, team_items(teams), many=True))

    @extend_schema(
        summary="Add a team (staff), with its limits and first members",
        request=TeamCreateInput,
        responses=answers({201: TeamOut}, 403, 409, body=True),
    )
    def post(self, request: Request) -> Response:
        data = validated(TeamCreateInput, request.data)
        name, members = data.pop("name"), data.pop("members", [])
        team = services.team_add(actor=actor_of(request), name=name, limits=data, members=members)
        return Response(_team_answer(request, team.name), status=status.HTTP_201_CREATED)


class TeamAPI(APIView):
    @extend_schema(
        summary="One team, its limits and what its keys used against them",
        responses=answers({200: TeamOut}, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        return Response(_team_answer(request, name))

    @extend_schema(
        summary="Change a team's limits (staff); fields not sent stay as they are",
        request=LimitsInput,
        responses=answers({200: TeamOut}, 403, 404, body=True),
    )
    def patch(self, request: Request, name: str) -> Response:
        changes = validated(LimitsInput, request.data)
        team = services.team_set_limits(actor=actor_of(request), name=name, changes=changes)
        return Response(_team_answer(request, team.name))

    @extend_schema(
        summary="Remove a team (staff); its keys stay, without the team's limits",
        request=None,
        responses=answers({200: TeamRemovedOut}, 403, 404),
    )
    def delete(self, request: Request, name: str) -> Response:
        keys = services.team_remove(actor=actor_of(request), name=name)
        return Response(out(TeamRemovedOut, {"name": name, "keys": keys}))


class TeamMembersAPI(APIView):
    @extend_schema(
        summary="Add and remove a team's members (staff and its team admins), and give or take "
        "away the team admin role (staff)",
        request=TeamMembersInput,
        responses=answers({200: TeamOut}, 403, 404, body=True),
    )
    def post(self, request: Request, name: str) -> Response:
        data = validated(TeamMembersInput, request.data)
        team = services.team_members(
            actor=actor_of(request),
            name=name,
            add=data.get("add", []),
            remove=data.get("remove", []),
            add_admins=data.get("add_admins", []),
            remove_admins=data.get("remove_admins", []),
        )
        return Response(_team_answer(request, team.name))


# -- people's weights in the fair queue ------------------------------------------------------


class UserWeightOut(serializers.Serializer):
    user = serializers.CharField(help_text="the person's username")
    weight = serializers.FloatField(
        allow_null=True, help_text="their weight in the fair queue; null: none set"
    )


class UserWeightsOut(serializers.Serializer):
    people = UserWeightOut(many=True)


class UserWeightInput(StrictSerializer):
    weight = serializers.FloatField(
        allow_null=True,
        help_text="above 0, at most 1000: their share of a model's slots beside others when "
        "requests queue (in a team: of the team's share); null: none (1 in a team, their "
        "heaviest key's weight outside one)",
    )


class UserWeightsAPI(APIView):
    @extend_schema(
        summary="The people staff gave a weight in the fair queue (staff see everyone's)",
        responses=answers({200: UserWeightsOut}),
    )
    def get(self, request: Request) -> Response:
        people = services.user_weights(actor=actor_of(request))
        return Response(out(UserWeightsOut, {"people": [
            {"user": name, "weight": weight} for name, weight in people
        ]}))  # fmt: skip


class UserWeightAPI(APIView):
    @extend_schema(
        summary="Set a person's weight in the fair queue, or clear it with null (staff)",
        request=UserWeightInput,
        responses=answers({200: UserWeightOut}, 403, body=True),
    )
    def put(self, request: Request, username: str) -> Response:
        data = validated(UserWeightInput, request.data)
        row = services.user_weight_set(
            actor=actor_of(request), username=username, weight=data["weight"]
        )
        return Response(
            out(UserWeightOut, {"user": username, "weight": None if row is None else row.weight})
        )


# -- key policies ---------------------------------------------------------------------------


class KeyPolicyOut(serializers.Serializer):
    scope = serializers.CharField(
        help_text="default (every user's keys in no team), team:NAME (its keys) or user:NAME "
        "(their keys in no team)"
    )
    defaults = PolicyFiguresOut(help_text="what a new key gets of each limit not given")
    ceilings = PolicyFiguresOut(help_text="the most a key's owner may set each limit to")
    changed_at = serializers.DateTimeField()


class KeyPolicySetOut(KeyPolicyOut):
    lowered = serializers.IntegerField(
        help_text="keys under it that were above a ceiling (or without that limit), lowered to it"
    )


@with_limits(_counter_field)
class PolicyFiguresInput(StrictSerializer):
    """One figure per limit; a limit not sent is left as it is."""


class KeyPolicyInput(StrictSerializer):
    """A limit not sent stays as it is; 0 or null takes its default or ceiling away."""

    defaults = PolicyFiguresInput(
        required=False, help_text="what a new key gets of each limit not given"
    )
    ceilings = PolicyFiguresInput(
        required=False,
        help_text="the most a key's owner may set each limit to; keys above one are lowered to it",
    )


class KeyPolicyRemovedOut(serializers.Serializer):
    scope = serializers.CharField()


class KeyPoliciesAPI(APIView):
    @extend_schema(
        summary="Key policies: every one (staff); those that may hold your keys (others)",
        responses=answers({200: KeyPolicyOut(many=True)}),
    )
    def get(self, request: Request) -> Response:
        found = selectors.policies_visible_to(actor_of(request))
        return Response(out(KeyPolicyOut, [selectors.policy_view(p) for p in found], many=True))


class KeyPolicyAPI(APIView):
    @extend_schema(
        summary="One key policy: default, team:NAME or user:NAME",
        responses=answers({200: KeyPolicyOut}, 404),
    )
    def get(self, request: Request, scope: str) -> Response:
        found = [p for p in selectors.policies_visible_to(actor_of(request)) if p.scope == scope]
        if not found:
            raise Refused(
                f"There is no key policy {scope[:100]} that holds your keys; `llmgw ctl key "
                "policies` lists them.",
                code="not_found",
                status=404,
            )
        return Response(out(KeyPolicyOut, selectors.policy_view(found[0])))

    @extend_schema(
        summary="Set a key policy's defaults and ceilings (staff), making it if there is none",
        description="A limit not sent stays as it is; 0 or null takes it away. The keys under it "
        "above a ceiling (or without that limit) are lowered to it, except staff's own keys and a "
        "limit staff set on the key itself.",
        request=KeyPolicyInput,
        responses=answers({200: KeyPolicySetOut}, 403, 404, 409, body=True),
    )
    def patch(self, request: Request, scope: str) -> Response:
        data = validated(KeyPolicyInput, request.data)
        policy, lowered = services.policy_set(
            actor=actor_of(request),
            scope=scope,
            defaults=data.get("defaults"),
            ceilings=data.get("ceilings"),
        )
        return Response(out(KeyPolicySetOut, {**selectors.policy_view(policy), "lowered": lowered}))

    @extend_schema(
        summary="Remove a key policy (staff); its keys keep their limits",
        request=None,
        responses=answers({200: KeyPolicyRemovedOut}, 403, 404),
    )
    def delete(self, request: Request, scope: str) -> Response:
        policy = services.policy_remove(actor=actor_of(request), scope=scope)
        return Response(out(KeyPolicyRemovedOut, {"scope": policy.scope}))
