"""The API kit every app's REST endpoints are made of: the refusal's shape, the answers an
operation declares, output shaped by its serializer, validated input, and the actor of a request.

Every refusal (core.refusals.Refused, DRF's own, a body too large) is answered as ErrorOut by
llmgw_site.api_errors; `answers` puts the same shape in the schema for each status an operation
may refuse with.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiSerializerExtension
from rest_framework import serializers
from rest_framework.request import Request

from .actor import Actor
from .serializers import StrictSerializer


class ProblemOut(serializers.Serializer):
    field = serializers.CharField(
        help_text="the field, like profiles[0].memory_gb; empty for the whole"
    )
    message = serializers.CharField()
    line = serializers.IntegerField(required=False, help_text="its line, for YAML input")


class ErrorOut(serializers.Serializer):
    detail = serializers.CharField(help_text="what was wrong and what to do, in a sentence")
    code = serializers.CharField(help_text="a stable code, like invalid, not_found, declared_model")
    problems = ProblemOut(many=True, required=False)
    line = serializers.IntegerField(required=False)


# The refusals every operation may give, and the ones an operation with a body adds.
ALWAYS = (401,)


WITH_BODY = (400, 413, 415)


def answers(ok: dict[int, Any], *refusals: int, body: bool = False) -> dict[int, Any]:
    """An operation's responses: what it answers when it works, and each refusal (ErrorOut)."""
    codes = sorted({*ALWAYS, *refusals, *(WITH_BODY if body else ())})
    return {**ok, **{code: ErrorOut for code in codes}}


def out(serializer: type[serializers.Serializer], data: Any, many: bool = False) -> Any:
    """`data` shaped by its output serializer: what is not declared there does not go out."""
    return serializer(data, many=many).data


class StrictSerializerScheme(OpenApiSerializerExtension):
    """Inputs refuse fields they do not know: the schema says so (additionalProperties)."""

    target_class = StrictSerializer
    match_subclasses = True

    def map_serializer(self, auto_schema: Any, direction: Any) -> Any:
        schema = auto_schema._map_basic_serializer(self.target, direction)
        schema["additionalProperties"] = False
        return schema


def actor_of(request: Request) -> Actor:
    door = "cli" if request.headers.get("X-LLMGW-Client") == "ctl" else "api"
    return Actor.for_user(request.user, door)


def validated(serializer_class: type[serializers.Serializer], data: Any) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)
