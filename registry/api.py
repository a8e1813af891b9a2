"""REST endpoints for serving from the registry, the update check, updates and rollbacks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.api import RolloutOut
from catalog.definitions import (
    MAX_CORES,
    MAX_MEMORY_GB,
    MAX_REPLICAS,
    MMPROJ_BLANK,
    validate_mmproj,
)
from catalog.models import Model
from catalog.services import get_model
from core.api import actor_of, answers, out, validated
from core.refusals import Refused
from core.serializers import StrictSerializer
from llmgw.engines import DEFAULT_ENGINE, engine_names

from . import canary, rollouts, updates
from .canary_api import CanaryInput, canary_settings_from
from .models import Fetch, Rollout
from .selectors import fetch_view, rollout_view, update_view


def validate_repo_id(value: str) -> None:
    if "--" in value or ".." in value or value.endswith(".git"):
        raise serializers.ValidationError(
            "a repository name cannot hold '--' or '..' nor end in '.git'; write it as the "
            "registry shows it, like Qwen/Qwen2.5-0.5B-Instruct-GGUF"
        )


# What a serve asks for; validated, its keys are serve_start's arguments (source=), so the API
# and the console's form pass it on whole. (A comment: the schema shows the base's docstring.)
class ServeInput(StrictSerializer):
    # The registry client's own rule for a repository id (huggingface_hub's validate_repo_id):
    # what it refuses never reaches a registry, and was answered as the registry's failure (502).
    repo = serializers.RegexField(
        r"^[A-Za-z0-9_]([A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?/[A-Za-z0-9_]([A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?$",
        max_length=200,
        validators=[validate_repo_id],
        error_messages={
            "invalid": "a repository is ORG/NAME, like Qwen/Qwen2.5-0.5B-Instruct-GGUF: each part "
            "1 to 96 letters, digits, '.', '_' and '-', starting and ending with a letter, digit "
            "or '_'"
        },
    )
    file = serializers.CharField(
        source="pattern",
        required=False,
        default=None,
        allow_null=True,
        max_length=500,
        help_text="a glob naming one GGUF file (default *.gguf); for an engine that loads a "
        "snapshot, globs separated by commas naming its files (default: its config, tokenizer "
        "and safetensors files)",
    )
    engine = serializers.ChoiceField(
        choices=list(engine_names()),
        required=False,
        default="",
        allow_blank=True,
        help_text=f"the engine the model runs (default {DEFAULT_ENGINE})",
    )
    revision = serializers.CharField(
        source="branch",
        required=False,
        default="main",
        max_length=200,
        help_text="the branch to follow",
    )
    name = serializers.CharField(
        required=False, allow_null=True, max_length=100, help_text="the model's name"
    )
    mmproj = serializers.CharField(
        required=False,
        default="",
        validators=[validate_mmproj],
        error_messages={"blank": MMPROJ_BLANK},
        help_text=(
            "the vision projector's path in the repository (like mmproj-model-f16.gguf), "
            "fetched with the weights so that the model takes images"
        ),
    )
    memory_gb = serializers.FloatField(
        required=False, allow_null=True, min_value=0, max_value=MAX_MEMORY_GB
    )
    cores = serializers.FloatField(
        required=False, allow_null=True, min_value=0, max_value=MAX_CORES
    )
    min = serializers.IntegerField(
        source="min_replicas", required=False, default=1, min_value=0, max_value=MAX_REPLICAS
    )
    max = serializers.IntegerField(
        source="max_replicas",
        required=False,
        allow_null=True,
        min_value=0,
        max_value=MAX_REPLICAS,
    )


class FileOut(serializers.Serializer):
    path = serializers.CharField()
    size = serializers.IntegerField()


class FetchOut(serializers.Serializer):
    id = serializers.IntegerField()
    repo = serializers.CharField()
    branch = serializers.CharField()
    commit = serializers.CharField()
    files = FileOut(many=True)
    state = serializers.CharField()
    bytes_done = serializers.IntegerField()
    bytes_total = serializers.IntegerField()
    message = serializers.CharField(allow_blank=True)
    model = serializers.CharField(allow_null=True, help_text="the model it is for, if any")
    model_added = serializers.BooleanField()


class UpdateOut(serializers.Serializer):
    model = serializers.CharField()
    repo = serializers.CharField(allow_null=True)
    current_commit = serializers.CharField(allow_null=True)
    new_commit = serializers.CharField(allow_null=True)
    files = serializers.ListField(child=serializers.DictField(), help_text="the files changed")
    bytes = serializers.IntegerField(allow_null=True)
    checked_at = serializers.DateTimeField(allow_null=True)
    error = serializers.CharField(allow_null=True)
    rolled_back_from = serializers.CharField(
        allow_null=True,
        help_text="the commit a rollback moved the model back from, when that is why the update "
        "is known (the newest revision a check saw, or the one rolled back from); null otherwise",
    )


class UpdatesOut(serializers.Serializer):
    updates = UpdateOut(many=True)


class UpdatesCheckOut(UpdatesOut):
    registry_requests = serializers.IntegerField()
    repositories = serializers.IntegerField(help_text="repositories asked about")
    failures = serializers.DictField(
        child=serializers.CharField(), help_text="repository: why asking it failed"
    )


class ServeAPI(APIView):
    @extend_schema(
        summary="Fetch a registry repository's GGUF file into the mirror, then add the model",
        request=ServeInput,
        responses=answers({202: FetchOut}, 403, 404, 409, 502, body=True),
    )
    def post(self, request: Request) -> Response:
        fetch = updates.serve_start(actor=actor_of(request), **validated(ServeInput, request.data))
        return Response(out(FetchOut, fetch_view(fetch)), status=status.HTTP_202_ACCEPTED)


class FetchAPI(APIView):
    @extend_schema(
        summary="A fetch into the mirror, with its progress",
        responses=answers({200: FetchOut}, 404),
    )
    def get(self, request: Request, pk: int) -> Response:
        fetch = Fetch.objects.filter(pk=pk).first() if pk < 2**62 else None
        if fetch is None:
            raise Refused(f"There is no fetch {pk}.", code="not_found", status=404)
        return Response(out(FetchOut, fetch_view(fetch)))


def _with_updates() -> Any:
    models = Model.objects.exclude(update_available=None) | Model.objects.exclude(
        update_check_error=""
    )
    return [update_view(m) for m in models.order_by("name")]


class UpdatesAPI(APIView):
    @extend_schema(
        summary="Served models whose registry files changed (or whose last check failed)",
        responses=answers({200: UpdatesOut}),
    )
    def get(self, request: Request) -> Response:
        return Response(out(UpdatesOut, {"updates": _with_updates()}))


class UpdatesCheckAPI(APIView):
    @extend_schema(
        summary="Ask the registry now: about every model for staff, about your own otherwise",
        request=None,
        responses=answers({200: UpdatesCheckOut}),
    )
    def post(self, request: Request) -> Response:
        report = updates.check_updates(actor=actor_of(request))
        body = {
            "updates": _with_updates(),
            "registry_requests": report.requests,
            "repositories": report.repositories,
            "failures": report.failures,
        }
        return Response(out(UpdatesCheckOut, body))


# Update and rollback answer alike: the rollout they started (202), which the caller follows.
class _StartRolloutAPI(APIView):
    start: Callable[..., Rollout]

    @extend_schema(request=None, responses=answers({202: RolloutOut}, 400, 403, 404, 409))
    def post(self, request: Request, name: str) -> Response:
        rollout = type(self).start(actor=actor_of(request), name=name)
        return Response(out(RolloutOut, rollout_view(rollout)), status=status.HTTP_202_ACCEPTED)


class UpdateAPI(_StartRolloutAPI):
    start = staticmethod(rollouts.start_update)

    @extend_schema(
        summary="Move a model to the newer registry files, one replica at a time; with `canary`, "
        "first one replica serving that percent of the requests, rolled back by itself when unhealthy",
        request=CanaryInput,
        responses=answers({202: RolloutOut}, 400, 403, 404, 409, body=True),
    )
    def post(self, request: Request, name: str) -> Response:
        settings_ = canary_settings_from(request.data)
        if settings_ is None:
            return super().post(request, name)
        rollout = canary.start_canary_update(
            actor=actor_of(request), name=name, settings_=settings_
        )
        return Response(out(RolloutOut, rollout_view(rollout)), status=status.HTTP_202_ACCEPTED)


@extend_schema_view(post=extend_schema(summary="Move a model back to its previous files"))
class RollbackAPI(_StartRolloutAPI):
    start = staticmethod(rollouts.start_rollback)


class RolloutAPI(APIView):
    @extend_schema(
        summary="A model's latest update or rollback and its progress",
        responses=answers({200: RolloutOut}, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        model = get_model(name)
        rollout = Rollout.objects.filter(model=model).first()
        if rollout is None:
            raise Refused(
                f"{name} has never been updated or rolled back.", code="not_found", status=404
            )
        return Response(out(RolloutOut, rollout_view(rollout)))
