"""The catalog's REST API under /api/v1/: validate the input, call a service, show what is in force.

`llmgw ctl` is a client of exactly these endpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import actor_of, answers, out, validated
from core.refusals import Problem, invalid
from core.serializers import DurationField, StrictSerializer

from . import selectors, services
from .config import current_config
from .definitions import (
    CLASSES,
    MAX_CORES,
    MAX_MEMORY_GB,
    MAX_REPLICAS,
    AdapterSerializer,
    ModelDefinitionSerializer,
    clean_definition,
    normalize,
)
from .models import Model
from .sources import human_size

# -- what the API answers: output serializers, the one source of both shape and schema --------


class ScalingOut(serializers.Serializer):
    min = serializers.IntegerField(help_text="the replica count")
    max = serializers.IntegerField(help_text="the ceiling in force")
    max_follows_min = serializers.BooleanField()
    on_demand = serializers.BooleanField()
    parked = serializers.BooleanField(help_text="min 0, max 0: in the catalog, not running")
    idle_timeout = serializers.CharField(help_text="in force, like 15m")


class FetchBytesOut(serializers.Serializer):
    bytes_done = serializers.IntegerField()
    bytes_total = serializers.IntegerField()


class RolloutOut(serializers.Serializer):
    id = serializers.IntegerField()
    kind = serializers.ChoiceField(choices=["update", "rollback"])
    state = serializers.CharField()
    from_commit = serializers.CharField(allow_blank=True)
    to_commit = serializers.CharField(allow_blank=True)
    from_source = serializers.CharField(allow_blank=True)
    to_source = serializers.CharField(allow_blank=True)
    replaced = serializers.IntegerField()
    total = serializers.IntegerField()
    step = serializers.CharField(allow_blank=True)
    message = serializers.CharField(allow_blank=True)
    asked_by = serializers.CharField(allow_blank=True)
    fetch = FetchBytesOut(allow_null=True)
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)


class PreviousOut(serializers.Serializer):
    source = serializers.CharField()  # type: ignore[assignment]
    commit = serializers.CharField(allow_null=True)


class ModelOut(serializers.Serializer):
    name = serializers.CharField()
    kind = serializers.ChoiceField(choices=["declared", "runtime"])
    owner = serializers.CharField(allow_null=True)
    class_ = serializers.CharField(help_text="the class in force")
    class_set = serializers.CharField(help_text="the class set, or default")
    scaling = ScalingOut()
    source_size = serializers.IntegerField(allow_null=True, help_text="bytes, when known")
    source_size_text = serializers.CharField(
        required=False, help_text="the size for people; only in the answer to an add"
    )
    generation = serializers.IntegerField()
    engine = serializers.CharField(
        help_text="the engine its replicas run (docs/engines.md): its definition's, else the default engine"
    )
    definition = serializers.DictField(help_text="the definition, as in server.yaml")
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    rollout_halted = serializers.CharField(allow_null=True)
    origin = serializers.DictField(
        allow_null=True, help_text="the registry repository, branch, commit and files"
    )
    update = serializers.DictField(allow_null=True, help_text="newer registry files, if any")  # type: ignore[assignment]
    update_check_error = serializers.CharField(allow_null=True)
    previous = PreviousOut(allow_null=True)
    rollout = RolloutOut(allow_null=True, help_text="the latest update or rollback")
    ready = serializers.IntegerField(help_text="replicas ready and in routing")
    replicas = serializers.IntegerField(help_text="replicas placed (any state)")
    desired = serializers.IntegerField(help_text="replicas the reconciler aims for now")
    autoscale = serializers.DictField(
        allow_null=True,
        help_text="the autoscale policy (wait, up_after, down_after) and the autoscaler's last "
        "decision (replicas, why, changed_at, figures); null without a policy",
    )

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        fields["class"] = fields.pop("class_")
        # Keep the order of the answer as people read it.
        order = ["name", "kind", "owner", "class"]
        return {**{k: fields[k] for k in order}, **fields}


class AuditEntryOut(serializers.Serializer):
    id = serializers.IntegerField()
    at = serializers.DateTimeField()
    actor = serializers.CharField()
    door = serializers.CharField(help_text="api, cli, console, admin, config or system")
    model = serializers.CharField()
    action = serializers.CharField()
    changes = serializers.DictField(help_text="field: [before, after]")
    before = serializers.DictField(allow_null=True)
    after = serializers.DictField(allow_null=True)
    note = serializers.CharField(allow_blank=True)
    trace_id = serializers.CharField(
        allow_blank=True,
        help_text="the trace of the work this entry is part of (a rollout's), when traced",
    )


class AuditPageOut(serializers.Serializer):
    entries = AuditEntryOut(many=True)
    next_before = serializers.IntegerField(
        allow_null=True, help_text="pass as before= for the next page; null on the last"
    )


class ClusterOut(serializers.Serializer):
    reconcile_interval = serializers.CharField()
    default_idle_timeout = serializers.CharField()
    node_lost_after = serializers.CharField()
    update_check = serializers.CharField()
    registry_endpoint = serializers.CharField()
    source_allowed_hosts = serializers.ListField(child=serializers.CharField())
    database = serializers.CharField(help_text="sqlite or postgresql")


def _flag(request: Request, name: str, default: bool = True) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false"):
        raise invalid([Problem(name, f"is true or false, not {raw!r}")], what="The query")
    return raw.lower() == "true"


SOURCE_CHECK = OpenApiParameter(
    "source_check",
    bool,
    description="false skips asking the source URL whether the weights are there",
)


# An endpoint that answers with models (ModelOut). A model's answer also holds what the apps
# above the catalog know of it: its replicas (fleet) and its latest rollout (registry).
# `describe` turns models into their answers; it is given where the URLs are routed
# (llmgw_site/urls.py, which sees every app), so the catalog imports none of them. (A comment,
# not a docstring: the schema would show a docstring as every operation's description.)
class ModelAnswerAPI(APIView):
    describe: Callable[[list[Model]], list[dict[str, Any]]] | None = None

    def answer(self, model: Model) -> Any:
        if self.describe is None:
            raise ImproperlyConfigured(f"{type(self).__name__} is routed without describe=")
        return out(ModelOut, self.describe([model])[0])


DEFINITION_BODY = {
    "application/json": ModelDefinitionSerializer,
    "application/yaml": ModelDefinitionSerializer,
}


class ModelsAPI(ModelAnswerAPI):
    @extend_schema(summary="List the models", responses=answers({200: ModelOut(many=True)}))
    def get(self, request: Request) -> Response:
        if self.describe is None:
            raise ImproperlyConfigured("ModelsAPI is routed without describe=")
        return Response(out(ModelOut, self.describe(list(selectors.model_queryset())), many=True))

    @extend_schema(
        summary="Add a model (its definition as JSON or YAML)",
        request=DEFINITION_BODY,
        parameters=[SOURCE_CHECK],
        responses=answers({201: ModelOut}, 403, 409, body=True),
    )
    def post(self, request: Request) -> Response:
        source_check = _flag(request, "source_check")
        data = request.data
        definition = clean_definition(data, lines=getattr(data, "lines", None))
        model = services.model_add(
            actor=actor_of(request), definition=definition, source_check=source_check
        )
        body = self.answer(model)
        if model.source_size is not None:
            body["source_size_text"] = human_size(model.source_size)
        return Response(body, status=status.HTTP_201_CREATED)


class ModelAPI(ModelAnswerAPI):
    @extend_schema(summary="One model", responses=answers({200: ModelOut}, 404))
    def get(self, request: Request, name: str) -> Response:
        return Response(self.answer(services.get_model(name)))

    @extend_schema(summary="Remove a runtime model", responses=answers({204: None}, 403, 404, 409))
    def delete(self, request: Request, name: str) -> Response:
        services.model_remove(actor=actor_of(request), name=name)
        return Response(status=status.HTTP_204_NO_CONTENT)


# Validated, the keys of ScaleInput and ResourcesInput are their service's arguments (source=).
class ScaleInput(StrictSerializer):
    min = serializers.IntegerField(
        source="min_replicas", min_value=0, max_value=MAX_REPLICAS, help_text="the replica count"
    )
    max = serializers.IntegerField(
        source="max_replicas",
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


class ScaleAPI(ModelAnswerAPI):
    @extend_schema(
        summary="Set a runtime model's replica count",
        request=ScaleInput,
        responses=answers({200: ModelOut}, 403, 404, 409, body=True),
    )
    def post(self, request: Request, name: str) -> Response:
        data = validated(ScaleInput, request.data)
        model = services.model_scale(actor=actor_of(request), name=name, **data)
        return Response(self.answer(model))


class ResourcesInput(StrictSerializer):
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
        required=False,
        allow_null=True,
        help_text="one profile; every profile when left out",
        error_messages={
            "blank": "name one of the model's profiles, or leave profile out for every profile"
        },
    )


class ResourcesAPI(ModelAnswerAPI):
    @extend_schema(
        summary="Set what a replica reserves",
        request=ResourcesInput,
        responses=answers({200: ModelOut}, 403, 404, 409, body=True),
    )
    def post(self, request: Request, name: str) -> Response:
        data = validated(ResourcesInput, request.data)
        model = services.model_set_resources(actor=actor_of(request), name=name, **data)
        return Response(self.answer(model))


class AutoscaleInput(StrictSerializer):
    wait = serializers.CharField(
        required=False,
        max_length=40,
        help_text="the queue wait (p50) the model is held under, like 2s",
    )
    up_after = serializers.CharField(
        required=False,
        max_length=40,
        help_text="how long the wait stays over it before a replica is added (30s)",
    )
    down_after = serializers.CharField(
        required=False,
        max_length=40,
        help_text="how long a replica's worth of slots stays unused before one is removed (10m)",
    )
    off = serializers.BooleanField(required=False, default=False, help_text="turn the policy off")


class AutoscaleAPI(ModelAnswerAPI):
    @extend_schema(
        summary="Turn a model's autoscale policy on or off",
        request=AutoscaleInput,
        responses=answers({200: ModelOut}, 403, 404, 409, body=True),
    )
    def post(self, request: Request, name: str) -> Response:
        data = validated(AutoscaleInput, request.data)
        off = data.pop("off")
        if off and data:
            raise invalid(
                [Problem("off", "turns the policy off: give it alone, without wait or windows")],
                what="The autoscale policy",
            )
        if not off and "wait" not in data:
            raise invalid(
                [Problem("wait", "is needed to turn the policy on (like 2s), or send off: true")],
                what="The autoscale policy",
            )
        model = services.model_autoscale(
            actor=actor_of(request), name=name, policy=None if off else data
        )
        return Response(self.answer(model))


class ClassInput(StrictSerializer):
    def get_fields(self) -> dict[str, serializers.Field]:
        # "class" cannot be an attribute name in Python.
        return {
            "class": serializers.ChoiceField(
                choices=[*CLASSES, "default"],
                allow_blank=True,
                help_text="default (or empty) follows the scaling: opportunistic on demand, "
                "else standard",
                error_messages={
                    "invalid_choice": "'{input}' is not a class: use "
                    f"{', '.join(CLASSES)} or default"
                },
            )
        }


class ClassAPI(ModelAnswerAPI):
    @extend_schema(
        summary="Set a model's class",
        request=ClassInput,
        responses=answers({200: ModelOut}, 403, 404, 409, body=True),
    )
    def post(self, request: Request, name: str) -> Response:
        data = validated(ClassInput, request.data)
        model = services.model_set_class(actor=actor_of(request), name=name, klass=data["class"])
        return Response(self.answer(model))


class OwnerInput(StrictSerializer):
    owner = serializers.CharField(
        max_length=150,
        help_text="the username of the new owner",
        error_messages={"blank": "give the username of the new owner"},
    )


class OwnerAPI(ModelAnswerAPI):
    @extend_schema(
        summary="Hand a model over to another user",
        request=OwnerInput,
        responses=answers({200: ModelOut}, 403, 404, 409, body=True),
    )
    def post(self, request: Request, name: str) -> Response:
        data = validated(OwnerInput, request.data)
        model = services.model_set_owner(actor=actor_of(request), name=name, username=data["owner"])
        return Response(self.answer(model))


class AdaptersInput(StrictSerializer):
    add = AdapterSerializer(many=True, required=False, default=list)
    remove = serializers.ListField(
        child=serializers.CharField(
            error_messages={"blank": "give the name of the adapter to remove"}
        ),
        required=False,
        default=list,
    )


class AdapterOut(serializers.Serializer):
    name = serializers.CharField()
    source = serializers.CharField()  # type: ignore[assignment]
    scale = serializers.FloatField()
    sha256 = serializers.CharField(required=False)


class AdaptersAPI(APIView):
    @extend_schema(
        summary="A model's LoRA adapters", responses=answers({200: AdapterOut(many=True)}, 404)
    )
    def get(self, request: Request, name: str) -> Response:
        return Response(out(AdapterOut, services.get_model(name).adapters, many=True))

    @extend_schema(
        summary="Remove, then add, LoRA adapters",
        request=AdaptersInput,
        parameters=[
            OpenApiParameter(
                "source_check", bool, description="false skips checking the adapter files"
            )
        ],
        responses=answers({200: AdapterOut(many=True)}, 403, 404, 409, body=True),
    )
    def post(self, request: Request, name: str) -> Response:
        source_check = _flag(request, "source_check")
        data = validated(AdaptersInput, request.data)
        add = normalize({"profiles": [], "adapters": data["add"]})["adapters"]
        model = services.model_set_adapters(
            actor=actor_of(request),
            name=name,
            add=add,
            remove=data["remove"],
            source_check=source_check,
        )
        return Response(out(AdapterOut, model.adapters, many=True))


class AuditAPI(APIView):
    @extend_schema(
        summary="The audit trail, newest first",
        parameters=[
            OpenApiParameter("model", str),
            OpenApiParameter("actor", str),
            OpenApiParameter("action", str),
            OpenApiParameter(
                "limit",
                int,
                description="at most this many entries (default 100; taken as 1 to 1000)",
            ),
            OpenApiParameter(
                "before", int, description="only entries older than this id (for the next page)"
            ),
        ],
        responses=answers({200: AuditPageOut}, 400),
    )
    def get(self, request: Request) -> Response:
        params = request.query_params
        try:
            limit = min(max(int(params.get("limit", "100")), 1), 1000)
            before = int(params["before"]) if "before" in params else None
            if before is not None:
                before = max(min(before, 2**62), -(2**62))  # what a database integer holds
        except (ValueError, TypeError):
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
        body = {"entries": page, "next_before": page[-1]["id"] if more and page else None}
        return Response(out(AuditPageOut, body))


class ClusterAPI(APIView):
    @extend_schema(
        summary="The cluster settings in force (server.yaml)", responses=answers({200: ClusterOut})
    )
    def get(self, request: Request) -> Response:
        body = {**current_config().summary(), "database": connection.vendor}
        return Response(out(ClusterOut, body))
