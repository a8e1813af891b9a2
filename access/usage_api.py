"""Usage per gateway key under /api/v1/usage: JSON for `llmgw ctl usage`, CSV for spreadsheets;
and a model's traffic through the gateway under /api/v1/models/NAME/traffic, for
`llmgw ctl model traffic`.

A user sees the usage of their own keys, a team admin also that of the keys in their teams, and
staff and viewers everyone's (access.roles).
Every signed-in user sees every model's traffic, as on the console's model page.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog import services as catalog_services
from core.api import actor_of, answers, out

from . import selectors, traffic

USAGE_COLUMNS = (
    "day",
    "key",
    "key_name",
    "key_prefix",
    "owner",
    "model",
    "requests",
    "prompt_tokens",
    "completion_tokens",
)

FORMATS = ("json", "csv")

USAGE_LIST = inline_serializer(
    "KeyUsageList",
    {
        "day": serializers.DateField(help_text="UTC"),
        "key": serializers.IntegerField(help_text="the gateway key's id"),
        "key_name": serializers.CharField(),
        "key_prefix": serializers.CharField(),
        "owner": serializers.CharField(),
        "model": serializers.CharField(help_text="the model or adapter asked for"),
        "requests": serializers.IntegerField(),
        "prompt_tokens": serializers.IntegerField(),
        "completion_tokens": serializers.IntegerField(),
    },
    many=True,
)


# A cell starting with one of these is a formula to a spreadsheet (OWASP's list: = + - @, and
# tab and carriage return, which some strip before looking).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_cell(value: Any) -> Any:
    """`value` as a spreadsheet shows it and never runs it: text that would start a formula gets
    a leading single quote (OWASP's rule for CSV injection).

    Key names are chosen by any user and usernames may start with + - @, so a key named
    =HYPERLINK(...) ran in the spreadsheet of whichever staff member opened the export.
    Numbers are written as they are: they are ours, and never negative.
    """
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


class CSVRenderer(BaseRenderer):
    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context=None):
        out = io.StringIO()
        if isinstance(data, list):
            writer = csv.DictWriter(out, fieldnames=USAGE_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows({k: spreadsheet_cell(v) for k, v in row.items()} for row in data)
        else:  # a refusal: its message, so a spreadsheet shows why
            rows = csv.writer(out)
            rows.writerow(["error"])
            rows.writerow([spreadsheet_cell((data or {}).get("detail", ""))])
        return out.getvalue().encode()


class UsageQuery(serializers.Serializer):
    key = serializers.IntegerField(
        required=False,
        min_value=1,
        max_value=2**62,  # what a database integer holds; no key has a larger id
        help_text="one gateway key's id (llmgw ctl keys lists them)",
    )
    model = serializers.CharField(required=False, max_length=200)
    since = serializers.DateField(required=False, help_text="the first day, YYYY-MM-DD (UTC)")


class UsageAPI(APIView):
    renderer_classes = [JSONRenderer, CSVRenderer]

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        # DRF answers a ?format= it has no renderer for with 404 and takes an empty one as
        # left out; the schema's enum says json or csv, so anything else is a 400 that says so.
        # (`force` is DRF choosing a renderer for an error answer: never refused.)
        wanted = request.query_params.get("format")
        if not force and wanted is not None and wanted not in FORMATS:
            shown = wanted if len(wanted) <= 40 else wanted[:40] + "…"
            raise serializers.ValidationError(
                {
                    "format": [
                        f"{shown!r} is not a format of this endpoint: use format=json or "
                        "format=csv (a spreadsheet), or leave it out for JSON"
                    ]
                }
            )
        return super().perform_content_negotiation(request, force)

    @extend_schema(
        summary="Requests and tokens per day, key and model (your keys and, for a team admin, "
        "their teams'; staff and viewers: everyone's)",
        parameters=[
            UsageQuery,
            OpenApiParameter("format", OpenApiTypes.STR, enum=list(FORMATS), required=False),
        ],
        responses=answers({200: USAGE_LIST}, 400),
    )
    def get(self, request: Request) -> Response:
        # A plain dict: an empty value (since=) is then refused, not taken as left out.
        query = UsageQuery(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        wanted = dict(query.validated_data)
        rows = selectors.key_usage(
            actor_of(request),
            key_id=wanted.get("key"),
            model=wanted.get("model"),
            since=wanted.get("since"),
        )
        response = Response(rows)
        if request.accepted_renderer.format == "csv":
            response["Content-Disposition"] = 'attachment; filename="llmgw-usage.csv"'
        return response


# -- a model's traffic ----------------------------------------------------------------------


# The three read the objects of access.traffic (Figures, Point, ModelTraffic).
class TrafficFiguresOut(serializers.Serializer):
    """What the gateway answered for the model, and how its requests fared in the fair queue."""

    requests = serializers.IntegerField(help_text="answers the gateway gave for the model")
    client_errors = serializers.IntegerField(help_text="answers 400-499")
    server_errors = serializers.IntegerField(help_text="answers 500-599")
    latency_p50_seconds = serializers.FloatField(
        source="latency_p50", allow_null=True, help_text="null without answers"
    )
    latency_p95_seconds = serializers.FloatField(
        source="latency_p95", allow_null=True, help_text="null without answers"
    )
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    queued = serializers.IntegerField(
        help_text="requests that waited in the gateway's fair queue for a free slot, because "
        "every slot of the model's replicas was busy (then served, timed out or hung up)"
    )
    queue_seconds_mean = serializers.FloatField(
        allow_null=True, help_text="their mean wait in seconds; null when none waited"
    )
    queue_seconds_max = serializers.FloatField(
        help_text="the longest of those waits in seconds; 0 when none waited"
    )
    queue_timeouts = serializers.IntegerField(
        help_text="waits that ran out (LLMGW_QUEUE_TIMEOUT): answered 503"
    )
    queue_full = serializers.IntegerField(
        help_text="requests refused at once because the queue was full (LLMGW_QUEUE_MAX): "
        "answered 429"
    )
    slowest_seconds = serializers.FloatField(
        help_text="the longest time the gateway spent answering one request; 0 without answers"
    )
    slowest_request = serializers.CharField(
        help_text="that request's ID (X-Request-ID): grep it in the gateway's log lines (var/log/), "
        "search llmgw.request_id in the tracing backend for its trace; empty without answers"
    )


class TrafficPointOut(TrafficFiguresOut):
    """One step of the window that had traffic."""

    start = serializers.DateTimeField(help_text="the step's first minute, UTC")
    tokens_per_second = serializers.FloatField(help_text="completion tokens a second over the step")

    def to_representation(self, instance: Any) -> dict[str, Any]:
        return {
            "start": self.fields["start"].to_representation(instance.start),
            **TrafficFiguresOut(instance.figures).data,
            "tokens_per_second": instance.tokens_per_second,
        }


class ModelTrafficOut(serializers.Serializer):
    """A model's traffic through the gateway over the last hour, day or week."""

    model = serializers.CharField()
    window = serializers.ChoiceField(choices=list(traffic.WINDOWS), source="window.name")
    start = serializers.DateTimeField(help_text="the window's beginning, UTC")
    end = serializers.DateTimeField(help_text="its end: the end of the step now under way")
    step_seconds = serializers.IntegerField(help_text="what each point covers")
    waiting_now = serializers.IntegerField(
        help_text="requests waiting in the fair queue for the model now, over the gateway "
        "processes of the machine that answers this (gateways on other machines are not seen)"
    )
    total = TrafficFiguresOut(help_text="the whole window")
    points = TrafficPointOut(many=True, help_text="the steps that had traffic, oldest first")


class ModelTrafficQuery(serializers.Serializer):
    window = serializers.ChoiceField(
        choices=list(traffic.WINDOWS),
        default="hour",
        help_text="the last hour (a point a minute), day (15 minutes) or week (an hour)",
        error_messages={
            "invalid_choice": "{input!r} is not a window: use hour, day or week (the default, "
            "hour, when left out)"
        },
    )


class ModelTrafficAPI(APIView):
    @extend_schema(
        summary="A model's traffic through the gateway, and its fair queue",
        description="Requests, errors, latency, tokens and the requests that waited for a free "
        "slot, over the last hour, day or week; the figures the console's model page charts. "
        "The gateway processes write them every few seconds.",
        parameters=[ModelTrafficQuery],
        responses=answers({200: ModelTrafficOut}, 400, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        query = ModelTrafficQuery(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        model = catalog_services.get_model(name)
        window = traffic.WINDOWS[query.validated_data["window"]]
        return Response(out(ModelTrafficOut, traffic.model_traffic(model.name, window)))
