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


class CSVRenderer(BaseRenderer):
    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context=None):
        out = io.StringIO()
        if isinstance(data, list):
            writer = csv.DictWriter(out, fieldnames=USAGE_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(data)
        else:  # a refusal: its message, so a spreadsheet shows why
            out.write(f"error\n{(data or {}).get('detail', '')}\n")
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

    @extend_schema(
        summary="Requests and tokens per day, key and model (your keys; staff: everyone's)",
        parameters=[
            UsageQuery,
            OpenApiParameter("format", OpenApiTypes.STR, enum=["json", "csv"], required=False),
        ],
        responses=answers({200: USAGE_LIST}, 400, 404),  # 404: a format it does not have
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
