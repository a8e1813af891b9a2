"""REST endpoints for serving from the registry, the update check, updates and rollbacks."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from . import updates
from .api import actor_of
from .definitions import MAX_CORES, MAX_MEMORY_GB, MAX_REPLICAS
from .errors import CatalogError
from .models import Fetch, Model, Rollout
from .selectors import fetch_view, rollout_view, update_view
from .services import get_model


class ServeInput(serializers.Serializer):
    repo = serializers.RegexField(
        r"^[A-Za-z0-9._-]+/[A-Za-z0-9._-]+$",
        max_length=200,
        error_messages={
            "invalid": "a repository is ORG/NAME, like Qwen/Qwen2.5-0.5B-Instruct-GGUF"
        },
    )
    file = serializers.CharField(required=False, default="*.gguf", max_length=500)
    revision = serializers.CharField(required=False, default="main", max_length=200)
    name = serializers.CharField(required=False, allow_null=True, max_length=100)
    memory_gb = serializers.FloatField(
        required=False, allow_null=True, min_value=0, max_value=MAX_MEMORY_GB
    )
    cores = serializers.FloatField(
        required=False, allow_null=True, min_value=0, max_value=MAX_CORES
    )
    min = serializers.IntegerField(required=False, default=1, min_value=0, max_value=MAX_REPLICAS)
    max = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=MAX_REPLICAS
    )


class ServeAPI(APIView):
    @extend_schema(
        summary="Fetch a registry repository's GGUF file into the mirror, then add the model",
        request=ServeInput,
        responses={202: OpenApiTypes.OBJECT},
    )
    def post(self, request: Request) -> Response:
        data = ServeInput(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        fetch = updates.serve_start(
            actor=actor_of(request),
            repo=v["repo"],
            pattern=v["file"],
            branch=v["revision"],
            name=v.get("name"),
            memory_gb=v.get("memory_gb"),
            cores=v.get("cores"),
            min_replicas=v["min"],
            max_replicas=v.get("max"),
        )
        return Response(fetch_view(fetch), status=status.HTTP_202_ACCEPTED)


class FetchAPI(APIView):
    @extend_schema(
        summary="A fetch into the mirror, with its progress", responses={200: OpenApiTypes.OBJECT}
    )
    def get(self, request: Request, pk: int) -> Response:
        fetch = Fetch.objects.filter(pk=pk).first()
        if fetch is None:
            raise CatalogError(f"There is no fetch {pk}.", code="not_found", status=404)
        return Response(fetch_view(fetch))


class UpdatesAPI(APIView):
    @extend_schema(
        summary="Served models whose registry files changed (or whose last check failed)",
        responses={200: OpenApiTypes.OBJECT},
    )
    def get(self, request: Request) -> Response:
        models = Model.objects.exclude(update_available=None) | Model.objects.exclude(
            update_check_error=""
        )
        return Response({"updates": [update_view(m) for m in models.order_by("name")]})


class UpdatesCheckAPI(APIView):
    @extend_schema(
        summary="Ask the registry now", request=None, responses={200: OpenApiTypes.OBJECT}
    )
    def post(self, request: Request) -> Response:
        report = updates.check_updates(actor=actor_of(request))
        models = Model.objects.exclude(update_available=None) | Model.objects.exclude(
            update_check_error=""
        )
        return Response(
            {
                "updates": [update_view(m) for m in models.order_by("name")],
                "registry_requests": report.requests,
                "repositories": report.repositories,
                "failures": report.failures,
            }
        )


class UpdateAPI(APIView):
    @extend_schema(
        summary="Move a model to the newer registry files, one replica at a time",
        request=None,
        responses={202: OpenApiTypes.OBJECT},
    )
    def post(self, request: Request, name: str) -> Response:
        rollout = updates.start_update(actor=actor_of(request), name=name)
        return Response(rollout_view(rollout), status=status.HTTP_202_ACCEPTED)


class RollbackAPI(APIView):
    @extend_schema(
        summary="Move a model back to its previous files",
        request=None,
        responses={202: OpenApiTypes.OBJECT},
    )
    def post(self, request: Request, name: str) -> Response:
        rollout = updates.start_rollback(actor=actor_of(request), name=name)
        return Response(rollout_view(rollout), status=status.HTTP_202_ACCEPTED)


class RolloutAPI(APIView):
    @extend_schema(
        summary="A model's latest update or rollback and its progress",
        responses={200: OpenApiTypes.OBJECT},
    )
    def get(self, request: Request, name: str) -> Response:
        model = get_model(name)
        rollout = Rollout.objects.filter(model=model).first()
        if rollout is None:
            raise CatalogError(
                f"{name} has never been updated or rolled back.", code="not_found", status=404
            )
        body: dict[str, Any] = rollout_view(rollout)
        return Response(body)
