"""REST endpoints of canary updates: start one (the update endpoint's body), follow it, promote
or abort it (registry.canary)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.services import get_model
from core.api import actor_of, answers, out, validated
from core.refusals import Refused
from core.serializers import StrictSerializer

from . import canary as service


def _range(allowed: str) -> dict[str, Any]:
    return {"min_value": f"must be {allowed}", "max_value": f"must be {allowed}"}


class CanaryInput(StrictSerializer):
    """The update endpoint's body; empty for a plain update."""

    canary = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=99,
        error_messages=_range("a whole percentage from 1 to 99"),
        help_text="percent of the model's requests the new revision gets on one replica, the rest "
        "going to the old one; left out, the update replaces every replica straight away",
    )
    # "for" is a Python keyword: the field is named in the body as "for".
    window = serializers.CharField(
        required=False,
        allow_null=True,
        max_length=40,
        help_text=f"how long the canary serves before it is promoted when healthy, like 10m "
        f"(default {service.DEFAULT_WINDOW})",
    )
    max_error_rate = serializers.FloatField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=1,
        error_messages=_range("a fraction from 0 up to (not including) 1, like 0.05 for 5%%"),
        help_text="the share of the new revision's answers that may be server errors, below 1 "
        f"(default {service.DEFAULT_MAX_ERROR_RATE})",
    )
    max_latency_ratio = serializers.FloatField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=service.MAX_LATENCY_RATIO_LIMIT,
        error_messages=_range(f"a number from 1 to {service.MAX_LATENCY_RATIO_LIMIT:g}"),
        help_text="how many times slower than the old revision the new one may answer on "
        f"average (default {service.DEFAULT_MAX_LATENCY_RATIO:g})",
    )

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        fields["for"] = fields.pop("window")
        return fields


def canary_settings_from(body: Any) -> service.CanarySettings | None:
    """The canary asked for in an update's body; None for a plain update."""
    given = validated(CanaryInput, body if body else {})
    percent = given.get("canary")
    options = {
        "window": given.get("for"),
        "max_error_rate": given.get("max_error_rate"),
        "max_latency_ratio": given.get("max_latency_ratio"),
    }
    if percent is None:
        named = [name for name, value in options.items() if value is not None]
        if named:
            flags = ", ".join("--" + n.replace("_", "-").replace("window", "for") for n in named)
            raise Refused(
                f"{flags} only mean something for a canary update; add --canary PERCENT, or "
                "leave them out for an update that replaces every replica straight away.",
                code="invalid_canary",
            )
        return None
    return service.canary_settings(percent=percent, **options)


class RevisionFiguresOut(serializers.Serializer):
    requests = serializers.IntegerField()
    server_errors = serializers.IntegerField(help_text="answers 500-599")
    error_rate = serializers.FloatField()
    mean_latency = serializers.FloatField(allow_null=True, help_text="seconds")


class CanaryKeysOut(serializers.Serializer):
    sending = serializers.IntegerField(help_text="keys the new revision answered")
    with_excess = serializers.IntegerField(
        help_text="keys that saw more server errors on the new revision than on the old"
    )
    excess_errors = serializers.FloatField(
        help_text="the new revision's server errors beyond each key's own rate on the old one"
    )


class CanaryOut(serializers.Serializer):
    model = serializers.CharField()
    state = serializers.ChoiceField(
        choices=["waiting", "watching", "promoted", "rolled back", "aborted", "ended"],
        help_text="waiting for its replica, watching (the window runs), or how it ended",
    )
    active = serializers.BooleanField(
        help_text="under way: its replica gets a share of the requests"
    )
    percent = serializers.IntegerField()
    from_commit = serializers.CharField(allow_blank=True)
    to_commit = serializers.CharField(allow_blank=True)
    from_revision = serializers.CharField(allow_blank=True, help_text="the old weights' revision")
    revision = serializers.CharField(allow_blank=True, help_text="the new weights' revision")
    window = serializers.CharField()
    max_error_rate = serializers.FloatField()
    max_latency_ratio = serializers.FloatField()
    asked_by = serializers.CharField(allow_blank=True)
    started_at = serializers.DateTimeField(allow_null=True, help_text="when the window started")
    ends_at = serializers.DateTimeField(allow_null=True)
    checks = serializers.IntegerField()
    checked_at = serializers.DateTimeField(allow_null=True)
    old = RevisionFiguresOut(help_text="the old revision's figures since the window started")
    new = RevisionFiguresOut(help_text="the new revision's figures since the window started")
    keys = CanaryKeysOut(
        help_text="the server errors judged per gateway key (no key counts beyond its share)"
    )
    verdict = serializers.CharField(allow_blank=True, help_text="what the last check found")
    decided_by = serializers.CharField(allow_blank=True)
    decision = serializers.CharField(allow_blank=True)
    decided_at = serializers.DateTimeField(allow_null=True)


class CanariesOut(serializers.Serializer):
    canaries = CanaryOut(many=True)


def _canary_of(name: str) -> dict[str, Any]:
    view = service.canary_view(get_model(name))
    if view is None:
        raise Refused(
            f"{name} has never had a canary update. Start one with `llmgw ctl model update "
            f"{name} --canary PERCENT`.",
            code="not_found",
            status=404,
        )
    return view


class CanariesAPI(APIView):
    @extend_schema(
        summary="Every model's canary update: those under way first, then the last outcomes",
        responses=answers({200: CanariesOut}),
    )
    def get(self, request: Request) -> Response:
        return Response(out(CanariesOut, {"canaries": service.canaries()}))


class CanaryAPI(APIView):
    @extend_schema(
        summary="A model's canary update, with both revisions' figures from the last check",
        responses=answers({200: CanaryOut}, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        return Response(out(CanaryOut, _canary_of(name)))


class CanaryPromoteAPI(APIView):
    @extend_schema(
        summary="Promote a canary now: the other replicas move to the new revision one at a time",
        request=None,
        responses=answers({200: CanaryOut}, 403, 404, 409),
    )
    def post(self, request: Request, name: str) -> Response:
        model = service.promote_canary(actor=actor_of(request), name=name)
        return Response(out(CanaryOut, service.canary_view(model)))


class CanaryAbortAPI(APIView):
    @extend_schema(
        summary="Abort a canary now: back to the old revision, whose replicas serve on",
        request=None,
        responses=answers({200: CanaryOut}, 403, 404, 409),
    )
    def post(self, request: Request, name: str) -> Response:
        model = service.abort_canary(actor=actor_of(request), name=name)
        return Response(out(CanaryOut, service.canary_view(model)))
