"""Usage per gateway key under /api/v1/usage: JSON for `llmgw ctl usage`, CSV for spreadsheets.

A user sees the usage of their own keys; staff see everyone's (as with the keys themselves).
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

from catalog.api import actor_of, answers

from . import selectors

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
        summary="Requests and tokens per day, key and model (your keys; staff: everyone's)",
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
