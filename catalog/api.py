"""The catalog's REST API under /api/v1/: validate the input, call a service, show what is in force.

`llmgw ctl` is a client of exactly these endpoints.
"""

from __future__ import annotations

from typing import Any

from django.db import connection
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from . import selectors, services
from .config import current_config
from .definitions import (
    MAX_CORES,
    MAX_MEMORY_GB,
    MAX_REPLICAS,
    AdapterSerializer,
    DurationField,
    ModelDefinitionSerializer,
    clean_definition,
    normalize,
)
from .errors import Problem, invalid
from .sources import human_size


def _model_view_fields() -> dict[str, serializers.Field]:
    return {
        "name": serializers.CharField(),
        "kind": serializers.ChoiceField(choices=["declared", "runtime"]),
        "owner": serializers.CharField(allow_null=True),
        "class": serializers.CharField(),
        "class_set": serializers.CharField(),
        "scaling": serializers.DictField(),
        "source_size": serializers.IntegerField(allow_null=True),
        "generation": serializers.IntegerField(),
        "rollout_halted": serializers.CharField(allow_null=True),
        "ready": serializers.IntegerField(help_text="replicas ready and in routing"),
        "replicas": serializers.IntegerField(help_text="replicas placed (any state)"),
        "desired": serializers.IntegerField(help_text="replicas the reconciler aims for now"),
        "definition": serializers.DictField(),
        "created_at": serializers.DateTimeField(),
        "updated_at": serializers.DateTimeField(),
    }


MODEL_VIEW = inline_serializer("ModelView", _model_view_fields())
MODEL_LIST = inline_serializer("ModelViewList", _model_view_fields(), many=True)
ERROR = inline_serializer(
    "Error",
    {
        "detail": serializers.CharField(),
        "code": serializers.CharField(),
        "problems": serializers.ListField(child=serializers.DictField(), required=False),
    },
)


def actor_of(request: Request) -> services.Actor:
    door = "cli" if request.headers.get("X-LLMGW-Client") == "ctl" else "api"
    return services.Actor.for_user(request.user, door)


def _flag(request: Request, name: str, default: bool = True) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


def _validated(serializer_class: type[serializers.Serializer], data: Any) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def _view(model: Any) -> dict[str, Any]:
    from fleet.selectors import model_status

    return selectors.model_view(model, current_config(), model_status([model])[model.pk])


class ModelsAPI(APIView):
    @extend_schema(summary="List the models", responses={200: MODEL_LIST})
    def get(self, request: Request) -> Response:
        from fleet.selectors import model_status

        config = current_config()
        models = list(selectors.model_queryset())
        status = model_status(models)
        rollouts = selectors.latest_rollouts(models)
        return Response(
            [selectors.model_view(m, config, status[m.pk], rollouts.get(m.pk)) for m in models]
        )

    @extend_schema(
        summary="Add a model (its definition as JSON or YAML)",
        request={
            "application/json": ModelDefinitionSerializer,
            "application/yaml": ModelDefinitionSerializer,
        },
        parameters=[
            OpenApiParameter(
                "source_check",
                bool,
                description="false skips asking the source URL whether the weights are there",
            )
        ],
        responses={201: MODEL_VIEW, 400: ERROR, 403: ERROR, 409: ERROR},
    )
    def post(self, request: Request) -> Response:
        data = request.data
        definition = clean_definition(data, lines=getattr(data, "lines", None))
        model = services.model_add(
            actor=actor_of(request),
            definition=definition,
            source_check=_flag(request, "source_check"),
        )
        body = _view(model)
        if model.source_size is not None:
            body["source_size_text"] = human_size(model.source_size)
        return Response(body, status=status.HTTP_201_CREATED)


class ModelAPI(APIView):
    @extend_schema(summary="One model", responses={200: MODEL_VIEW, 404: ERROR})
    def get(self, request: Request, name: str) -> Response:
        return Response(_view(services.get_model(name)))

    @extend_schema(
        summary="Remove a runtime model", responses={204: None, 403: ERROR, 404: ERROR, 409: ERROR}
    )
    def delete(self, request: Request, name: str) -> Response:
        services.model_remove(actor=actor_of(request), name=name)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ScaleInput(serializers.Serializer):
    min = serializers.IntegerField(
        min_value=0, max_value=MAX_REPLICAS, help_text="the replica count"
    )
    max = serializers.IntegerField(
        min_value=0,
        max_value=MAX_REPLICAS,
        required=False,
        allow_null=True,
        help_text="a ceiling; left out, it follows min",
    )
    idle_timeout = DurationField(
        required=False,
        allow_null=True,
        help_text="how long an on-demand model stays up unasked-for, like 15m; 0 takes the cluster default",
    )


class ScaleAPI(APIView):
    @extend_schema(
        summary="Set a runtime model's replica count",
        request=ScaleInput,
        responses={200: MODEL_VIEW, 400: ERROR, 403: ERROR, 409: ERROR},
    )
    def post(self, request: Request, name: str) -> Response:
        data = _validated(ScaleInput, request.data)
        model = services.model_scale(
            actor=actor_of(request),
            name=name,
            min_replicas=data["min"],
            max_replicas=data.get("max"),
            idle_timeout=data.get("idle_timeout"),
        )
        return Response(_view(model))


class ResourcesInput(serializers.Serializer):
    memory_gb = serializers.FloatField(
        min_value=0, max_value=MAX_MEMORY_GB, help_text="host RAM a replica reserves, in GB"
    )
    cores = serializers.FloatField(
        min_value=0,
        max_value=MAX_CORES,
        required=False,
        allow_null=True,
        help_text="CPU cores reserved; the engine's threads; 0 reserves none",
    )
    profile = serializers.CharField(
        required=False, allow_null=True, help_text="one profile; every profile when left out"
    )


class ResourcesAPI(APIView):
    @extend_schema(
        summary="Set what a replica reserves",
        request=ResourcesInput,
        responses={200: MODEL_VIEW, 400: ERROR, 403: ERROR},
    )
    def post(self, request: Request, name: str) -> Response:
        data = _validated(ResourcesInput, request.data)
        model = services.model_set_resources(
            actor=actor_of(request),
            name=name,
            memory_gb=data["memory_gb"],
            cores=data.get("cores"),
            profile=data.get("profile"),
        )
        return Response(_view(model))


class ClassInput(serializers.Serializer):
    class_ = serializers.CharField(
        allow_blank=True, help_text="critical, standard, opportunistic or default"
    )

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict) and "class" in data:
            data = {"class_": data["class"]}
        return super().to_internal_value(data)


class ClassAPI(APIView):
    @extend_schema(
        summary="Set a model's class",
        request=inline_serializer("ClassInput", {"class": serializers.CharField()}),
        responses={200: MODEL_VIEW, 400: ERROR, 403: ERROR},
    )
    def post(self, request: Request, name: str) -> Response:
        if not isinstance(request.data, dict) or "class" not in request.data:
            raise invalid(
                [Problem("class", "give the class: critical, standard, opportunistic or default")],
                what="The class",
            )
        model = services.model_set_class(
            actor=actor_of(request), name=name, klass=str(request.data["class"])
        )
        return Response(_view(model))


class OwnerInput(serializers.Serializer):
    owner = serializers.CharField(max_length=150, help_text="the username of the new owner")


class OwnerAPI(APIView):
    @extend_schema(
        summary="Hand a model over to another user",
        request=OwnerInput,
        responses={200: MODEL_VIEW, 400: ERROR, 403: ERROR},
    )
    def post(self, request: Request, name: str) -> Response:
        data = _validated(OwnerInput, request.data)
        model = services.model_set_owner(actor=actor_of(request), name=name, username=data["owner"])
        return Response(_view(model))


class AdaptersInput(serializers.Serializer):
    add = AdapterSerializer(many=True, required=False, default=list)
    remove = serializers.ListField(child=serializers.CharField(), required=False, default=list)


class AdaptersAPI(APIView):
    @extend_schema(
        summary="A model's LoRA adapters", responses={200: AdapterSerializer(many=True), 404: ERROR}
    )
    def get(self, request: Request, name: str) -> Response:
        return Response(services.get_model(name).adapters)

    @extend_schema(
        summary="Remove, then add, LoRA adapters",
        request=AdaptersInput,
        parameters=[
            OpenApiParameter(
                "source_check", bool, description="false skips checking the adapter files"
            )
        ],
        responses={200: AdapterSerializer(many=True), 400: ERROR, 403: ERROR},
    )
    def post(self, request: Request, name: str) -> Response:
        data = _validated(AdaptersInput, request.data)
        add = normalize({"profiles": [], "adapters": data["add"]})["adapters"]
        model = services.model_set_adapters(
            actor=actor_of(request),
            name=name,
            add=add,
            remove=data["remove"],
            source_check=_flag(request, "source_check"),
        )
        return Response(model.adapters)


class AuditAPI(APIView):
    @extend_schema(
        summary="The audit trail, newest first",
        parameters=[
            OpenApiParameter("model", str),
            OpenApiParameter("actor", str),
            OpenApiParameter("action", str),
            OpenApiParameter(
                "limit", int, description="at most this many entries (default 100, at most 1000)"
            ),
            OpenApiParameter(
                "before", int, description="only entries older than this id (for the next page)"
            ),
        ],
        responses={200: OpenApiTypes.OBJECT},
    )
    def get(self, request: Request) -> Response:
        params = request.query_params
        try:
            limit = min(max(int(params.get("limit", 100)), 1), 1000)
            before = int(params["before"]) if params.get("before") else None
        except ValueError:
            raise invalid(
                [Problem("limit", "limit and before are whole numbers")], what="The query"
            ) from None
        entries = selectors.audit_queryset(
            model=params.get("model"), actor=params.get("actor"), action=params.get("action")
        )
        if before is not None:
            entries = entries.filter(id__lt=before)
        page = [selectors.audit_view(e) for e in entries[: limit + 1]]
        more = len(page) > limit
        page = page[:limit]
        return Response({"entries": page, "next_before": page[-1]["id"] if more and page else None})


class ClusterAPI(APIView):
    @extend_schema(
        summary="The cluster settings in force (server.yaml)", responses={200: OpenApiTypes.OBJECT}
    )
    def get(self, request: Request) -> Response:
        return Response({**current_config().summary(), "database": connection.vendor})
