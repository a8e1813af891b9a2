"""The fleet's REST API: nodes (staff), the node-facing heartbeat, restarts, demand, targets and plans."""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import APIException, AuthenticationFailed
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog import services as catalog_services
from catalog.config import current_config
from catalog.definitions import ModelDefinitionSerializer, clean_definition
from catalog.models import Model
from catalog.services import apply_definition, get_model
from core.api import actor_of, answers, out, validated
from core.metrics import control_metrics
from core.serializers import FieldsOncePerThread, StrictSerializer, TypedSerializer
from llmgw.units import format_bytes

from . import footprint, selectors, services
from .apps import this_process
from .models import Node

# -- node authentication ------------------------------------------------------------


class NodeRemoved(APIException):
    """A lately removed node's token (fleet.models.RemovedNode): 410, which its agent takes as
    the word to stop its engines and exit; a token never known is 401, as before."""

    status_code = status.HTTP_410_GONE
    default_code = "node_removed"


class NodeTokenAuthentication(BaseAuthentication):
    """Only node tokens, only on the node-facing API; user tokens are refused here."""

    def authenticate(self, request: Request) -> tuple[Node, str] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        keyword, _, token = header.partition(" ")
        if keyword.lower() not in ("bearer", "token") or not token.strip():
            return None
        node = services.authenticate_node(token.strip())
        if node is None:
            removed = services.removed_node(token.strip())
            if removed is not None:
                raise NodeRemoved(removed.message)
            raise AuthenticationFailed(
                "This is not a node token the control plane knows. Use the token `llmgw ctl node add` "
                "printed for this node; if the node was removed, add it again."
            )
        node.is_authenticated = True  # type: ignore[attr-defined]
        return node, token

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"


class NodeTokenScheme(OpenApiAuthenticationExtension):
    target_class = NodeTokenAuthentication
    name = "nodeToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "the node's token, printed once by `llmgw ctl node add`",
        }


class IsNode(BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.user, Node)


class CapacityInput(TypedSerializer):
    memory_gb = serializers.FloatField(min_value=0, max_value=1_000_000)
    cores = serializers.FloatField(min_value=0, max_value=100_000)
    gpus = serializers.IntegerField(min_value=0, max_value=1024, default=0)
    gpu_memory_gb = serializers.FloatField(min_value=0, max_value=1_000_000, default=0)


class ReplicaReportInput(TypedSerializer):
    id = serializers.UUIDField()
    state = serializers.ChoiceField(choices=["fetching", "starting", "ready", "failed", "stopped"])
    port = serializers.IntegerField(min_value=1, max_value=65535, required=False, allow_null=True)
    message = serializers.CharField(required=False, allow_blank=True, default="", max_length=20000)
    progress = serializers.DictField(required=False, allow_null=True)
    sha256 = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=64)
    slots = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1024)
    # The engine's own numbers (llmgw.engine.METRIC_NAMES and tokens_per_second).
    engine = serializers.DictField(
        child=serializers.FloatField(min_value=0, max_value=1e18),
        required=False,
        allow_null=True,
    )

    def to_internal_value(self, data: Any) -> Any:
        engine = data.get("engine") if isinstance(data, dict) else None
        if isinstance(engine, dict):
            # A JSON true is not the number 1 (DRF's FloatField would take it as one).
            if any(isinstance(v, bool) or not isinstance(v, int | float) for v in engine.values()):
                raise serializers.ValidationError({"engine": ["every value must be a number"]})
            if len(engine) > 32 or any(len(str(key)) > 64 for key in engine):
                raise serializers.ValidationError(
                    {"engine": ["at most 32 numbers with names of 64 characters"]}
                )
        value = super().to_internal_value(data)
        value["id"] = str(value["id"])
        return value


class PortRangeInput(TypedSerializer):
    first = serializers.IntegerField(min_value=1, max_value=65535)
    last = serializers.IntegerField(min_value=1, max_value=65535)


# Bounds on what a node may say of its GPUs: more is not a machine, it is a lie or a bug.
MAX_DEVICES = 64
MAX_DEVICE_MEMORY_MB = 16 * 1024 * 1024  # 16 TB on one device
MAX_BACKENDS = 16
MAX_ENGINES = 8


class DeviceInput(TypedSerializer):
    index = serializers.IntegerField(min_value=0, max_value=1023)
    uuid = serializers.CharField(max_length=100, allow_blank=True, required=False, default="")
    name = serializers.CharField(max_length=200, allow_blank=True, required=False, default="")
    memory_total_mb = serializers.IntegerField(min_value=0, max_value=MAX_DEVICE_MEMORY_MB)
    memory_used_mb = serializers.IntegerField(min_value=0, max_value=MAX_DEVICE_MEMORY_MB)
    utilization_pct = serializers.IntegerField(
        min_value=0, max_value=100, allow_null=True, required=False, default=None
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["memory_used_mb"] > attrs["memory_total_mb"]:
            # A driver can count a little over; the device is full, not bigger than it is.
            attrs["memory_used_mb"] = attrs["memory_total_mb"]
        return attrs


class HeartbeatInput(FieldsOncePerThread, TypedSerializer):
    capacity = CapacityInput()
    devices = DeviceInput(
        many=True,
        required=False,
        default=list,
        max_length=MAX_DEVICES,  # type: ignore[call-arg]
        help_text=(
            "its GPUs as its agent found them (NVML or nvidia-smi) or was told (--gpus); memory "
            "used counts every process on the device"
        ),
    )
    devices_source = serializers.ChoiceField(
        choices=["nvml", "nvidia-smi", "flags", ""], required=False, default=""
    )
    engine_backends = serializers.ListField(
        child=serializers.CharField(max_length=40),
        required=False,
        default=list,
        max_length=MAX_BACKENDS,
        help_text="the backends its default engine was built with (--list-devices): CPU, CUDA, ...",
    )
    engines = serializers.ListField(
        child=serializers.CharField(max_length=40),
        required=False,
        default=list,
        max_length=MAX_ENGINES,
        help_text="the engines its agent has installed (docs/engines.md); left out: the default "
        "engine only",
    )
    gpu_engines = serializers.ListField(
        child=serializers.CharField(max_length=40),
        required=False,
        default=list,
        max_length=MAX_ENGINES,
        help_text="those of its engines that can put a model on its GPUs",
    )
    address = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=255,
        help_text=(
            "where its engines listen: the address it connects from, one staff allowed for it, "
            "or 0.0.0.0 (or none) for the address it connects from"
        ),
    )
    port_range = PortRangeInput(
        required=False,
        help_text="the ports its engines listen on (llmgw node --port-range); 41000-41999 if absent",
    )
    agent = serializers.DictField(required=False)
    report_digest = serializers.RegexField(
        r"^[0-9a-f]{64}$",
        required=False,
        allow_blank=True,
        default="",
        help_text=(
            "the agent's digest of this report (sha256, hex): its renewals name it while "
            "nothing on the node changes"
        ),
    )
    replicas = ReplicaReportInput(many=True, required=False, default=list, max_length=10000)  # type: ignore[call-arg]

    def validate_devices(self, devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        indices = [d["index"] for d in devices]
        if len(set(indices)) != len(indices):
            raise serializers.ValidationError(
                "two devices have the same index; report each GPU once (NVML's index)"
            )
        return sorted(devices, key=lambda d: d["index"])


GENERATION_HELP = (
    "the version of what the node should run that this answer holds; null while it changes on "
    "its own (a replica draining): a renewal naming it is answered without the replicas"
)


class HeartbeatOut(FieldsOncePerThread, serializers.Serializer):
    node = serializers.CharField()
    heartbeat_interval = serializers.IntegerField(
        help_text="seconds until the next heartbeat or renewal; grows with the fleet"
    )
    generation = serializers.IntegerField(allow_null=True, help_text=GENERATION_HELP)
    replicas = serializers.ListField(
        child=serializers.DictField(), help_text="every replica the node should run, in full"
    )
    keep = serializers.ListField(
        child=serializers.DictField(),
        help_text=(
            "files ({source, sha256}) to keep cached though no replica uses them: the previous "
            "revisions of the node's models"
        ),
    )
    warnings = serializers.ListField(
        child=serializers.CharField(),
        help_text="what of its report the control plane does not believe, and what to do",
    )


class HeartbeatAPI(APIView):
    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNode]

    @extend_schema(
        summary="A node's heartbeat: its capacity and replica states; the answer is what it should run",
        request=HeartbeatInput,
        responses=answers({200: HeartbeatOut}, 403, 410, body=True),
    )
    def post(self, request: Request) -> Response:
        data = HeartbeatInput(data=request.data)
        data.is_valid(raise_exception=True)
        node = request.user
        assert isinstance(node, Node)  # IsNode let only nodes through
        answer = services.node_heartbeat(
            node=node,
            report=dict(data.validated_data),
            interval=this_process().fleet_size.heartbeat_interval(),
            # The peer the web saw; behind the gateway, the gateway's own peer (gateway.forwarded).
            peer=request.META.get("REMOTE_ADDR") or "",
        )
        control_metrics().node_heartbeats.labels("full", "changed").inc()
        return Response(out(HeartbeatOut, answer))


class RenewInput(FieldsOncePerThread, TypedSerializer):
    generation = serializers.IntegerField(
        min_value=0,
        allow_null=True,
        required=False,
        default=None,
        help_text="the generation of the last answer the node acted on",
    )
    report_digest = serializers.RegexField(
        r"^[0-9a-f]{64}$", help_text="the digest of the node's last full report, which still holds"
    )


class RenewOut(FieldsOncePerThread, serializers.Serializer):
    node = serializers.CharField()
    heartbeat_interval = serializers.IntegerField(
        help_text="seconds until the next heartbeat or renewal; grows with the fleet"
    )
    report = serializers.ChoiceField(
        choices=["current", "send"],
        help_text=(
            "current: the renewal was taken; send: it was not, send the whole report now (a "
            "heartbeat): the control plane holds another report, or the node is, or may be, lost"
        ),
    )
    changed = serializers.BooleanField(
        help_text="whether replicas, keep and warnings follow: what the node should run changed"
    )
    generation = serializers.IntegerField(allow_null=True, help_text=GENERATION_HELP)
    replicas = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        help_text="only when changed: every replica the node should run, in full",
    )
    keep = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        help_text="only when changed: as a heartbeat's",
    )
    warnings = serializers.ListField(
        child=serializers.CharField(),
        required=False,
        help_text="only when changed: as a heartbeat's",
    )


class RenewAPI(APIView):
    """The cheap heartbeat: liveness, without the report, while nothing on the node changed."""

    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNode]

    @extend_schema(
        summary="A node's renewal: it is alive and its last report holds; the answer says "
        "whether what it should run changed",
        request=RenewInput,
        responses=answers({200: RenewOut}, 403, 410, body=True),
    )
    def post(self, request: Request) -> Response:
        data = RenewInput(data=request.data)
        data.is_valid(raise_exception=True)
        node = request.user
        assert isinstance(node, Node)
        process = this_process()
        answer = services.node_renew(
            node=node,
            generation=data.validated_data["generation"],
            report_digest=data.validated_data["report_digest"],
            interval=process.fleet_size.heartbeat_interval(),
            liveness=process.liveness,
        )
        outcome = (
            "report"
            if answer["report"] == "send"
            else ("changed" if answer["changed"] else "unchanged")
        )
        control_metrics().node_heartbeats.labels("renewal", outcome).inc()
        return Response(out(RenewOut, answer))


# -- nodes, for people --------------------------------------------------------------


ADDRESS_ALLOW_HELP = (
    "networks (CIDR, or single addresses) the node may report as its engines' address besides "
    "the one it connects from: for a node behind NAT or with several interfaces"
)


class NodeAddInput(StrictSerializer):
    name = serializers.CharField(
        max_length=100,
        error_messages={
            "blank": "give the node a name, like gpu-1: letters, digits, '.', '_', '-' and ':'"
        },
    )
    address_allow = serializers.ListField(
        child=serializers.CharField(max_length=64),
        required=False,
        default=list,
        max_length=32,
        help_text=ADDRESS_ALLOW_HELP,
    )


class NodeSetInput(StrictSerializer):
    address_allow = serializers.ListField(
        child=serializers.CharField(max_length=64), max_length=32, help_text=ADDRESS_ALLOW_HELP
    )


class ResourcesOut(serializers.Serializer):
    memory_gb = serializers.FloatField()
    cores = serializers.FloatField()
    gpus = serializers.IntegerField()
    gpu_memory_gb = serializers.FloatField()


class PortRangeOut(serializers.Serializer):
    first = serializers.IntegerField()
    last = serializers.IntegerField()


class DeviceOut(serializers.Serializer):
    index = serializers.IntegerField()
    uuid = serializers.CharField()
    name = serializers.CharField()
    memory_total_gb = serializers.FloatField()
    reserved_gb = serializers.FloatField(help_text="what llmgw's replicas on it reserve")
    used_by_others_gb = serializers.FloatField(
        help_text="observed in use beyond llmgw's reservations: other programs"
    )
    used_gb = serializers.FloatField(help_text="observed in use, by every process")
    free_gb = serializers.FloatField(
        help_text="what placement may still give: the total less the larger of reserved and used"
    )
    utilization_pct = serializers.IntegerField(allow_null=True)


class NodeOut(serializers.Serializer):
    name = serializers.CharField()
    state = serializers.CharField()
    address = serializers.CharField(
        allow_null=True, help_text="where its engines listen; shown to staff only"
    )
    capacity = ResourcesOut()
    reserved = ResourcesOut()
    free = ResourcesOut()
    replicas = serializers.ListField(
        child=serializers.CharField(), help_text="the models of its replicas"
    )
    last_heartbeat = serializers.DateTimeField(allow_null=True)
    address_allow = serializers.ListField(
        child=serializers.CharField(),
        allow_null=True,
        help_text=ADDRESS_ALLOW_HELP + "; shown to staff only",
    )
    port_range = PortRangeOut(
        allow_null=True, help_text="the ports its engines may listen on; shown to staff only"
    )
    reported = ResourcesOut(
        allow_null=True,
        help_text="what its agent last reported; capacity is what of it is believed",
    )
    warnings = serializers.ListField(
        child=serializers.CharField(), help_text="reported figures not believed, and why"
    )
    devices = DeviceOut(many=True, help_text="its GPUs, each with its memory")
    devices_source = serializers.CharField(
        help_text="where the GPUs were found: nvml, nvidia-smi, flags (--gpus), or empty"
    )
    engine_backends = serializers.ListField(
        child=serializers.CharField(),
        help_text="the backends its engine was built with (CPU, CUDA): GPU replicas need one",
    )
    engines = serializers.ListField(
        child=serializers.CharField(),
        help_text="the engines its agent has installed: a model's replicas go only to nodes "
        "that have its engine",
    )
    gpu_engines = serializers.ListField(
        child=serializers.CharField(),
        help_text="those of its engines with a GPU backend: a GPU replica goes only to a node "
        "where its model's engine has one",
    )


class NewNodeOut(serializers.Serializer):
    name = serializers.CharField()
    token = serializers.CharField(help_text="the node's token: shown only in this answer")


class CordonOut(serializers.Serializer):
    name = serializers.CharField()
    state = serializers.CharField()
    cordoned = serializers.BooleanField()


class NodesAPI(APIView):
    @extend_schema(
        summary="The nodes: capacity, reserved, free, replicas, last heartbeat",
        responses=answers({200: NodeOut(many=True)}),
    )
    def get(self, request: Request) -> Response:
        nodes = selectors.nodes_view(addresses=actor_of(request).is_staff)
        return Response(out(NodeOut, nodes, many=True))

    @extend_schema(
        summary="Register a node (staff); the answer holds its token, shown only once",
        request=NodeAddInput,
        responses=answers({201: NewNodeOut}, 403, 409, body=True),
    )
    def post(self, request: Request) -> Response:
        data = validated(NodeAddInput, request.data)
        node, token = services.node_add(
            actor=actor_of(request), name=data["name"], address_allow=data["address_allow"]
        )
        body = out(NewNodeOut, {"name": node.name, "token": token})
        return Response(body, status=status.HTTP_201_CREATED)


def _node_view(name: str) -> dict[str, Any]:
    (view,) = selectors.nodes_view(addresses=True, name=name)
    return view


class NodeAPI(APIView):
    @extend_schema(
        summary="Change a node (staff): the networks it may report as its engines' address",
        request=NodeSetInput,
        responses=answers({200: NodeOut}, 403, 404, body=True),
    )
    def patch(self, request: Request, name: str) -> Response:
        data = validated(NodeSetInput, request.data)
        node = services.node_set(
            actor=actor_of(request), name=name, address_allow=data["address_allow"]
        )
        return Response(out(NodeOut, _node_view(node.name)))

    @extend_schema(
        summary="Remove a node (staff); its replicas are placed elsewhere",
        responses=answers({204: None}, 403, 404),
    )
    def delete(self, request: Request, name: str) -> Response:
        services.node_remove(actor=actor_of(request), name=name)
        return Response(status=status.HTTP_204_NO_CONTENT)


class NodeCordonAPI(APIView):
    cordon = True

    @extend_schema(
        summary="Cordon or uncordon a node (staff)",
        request=None,
        responses=answers({200: CordonOut}, 403, 404),
    )
    def post(self, request: Request, name: str) -> Response:
        node = services.node_cordon(actor=actor_of(request), name=name, cordoned=self.cordon)
        body = {"name": node.name, "state": node.state, "cordoned": node.cordoned}
        return Response(out(CordonOut, body))


class NodeUncordonAPI(NodeCordonAPI):
    cordon = False


class NodeAcceptCapacityAPI(APIView):
    @extend_schema(
        summary="Believe the capacity a node reports (staff), above what it first registered",
        request=None,
        responses=answers({200: NodeOut}, 403, 404, 409),
    )
    def post(self, request: Request, name: str) -> Response:
        node = services.node_accept_capacity(actor=actor_of(request), name=name)
        return Response(out(NodeOut, _node_view(node.name)))


# -- models at runtime --------------------------------------------------------------


class RestartOut(serializers.Serializer):
    model = serializers.CharField()
    generation = serializers.IntegerField(help_text="replicas of older generations are replaced")


class DemandOut(serializers.Serializer):
    model = serializers.CharField()
    on_demand = serializers.BooleanField()
    demand_at = serializers.DateTimeField(allow_null=True)


class RestartAPI(APIView):
    @extend_schema(
        summary="Rolling restart: replace every replica, one at a time",
        request=None,
        responses=answers({200: RestartOut}, 403, 404),
    )
    def post(self, request: Request, name: str) -> Response:
        model = catalog_services.model_restart(actor=actor_of(request), name=name)
        return Response(out(RestartOut, {"model": model.name, "generation": model.generation}))


class DemandAPI(APIView):
    @extend_schema(
        summary="Ask for a model now (its owner or staff): loads an on-demand model and restarts "
        "its idle clock",
        request=None,
        responses=answers({200: DemandOut}, 403, 404),
    )
    def post(self, request: Request, name: str) -> Response:
        model = catalog_services.model_demand(name=name, actor=actor_of(request))
        body = {
            "model": model.name,
            "on_demand": model.on_demand,
            "demand_at": model.demand_at.isoformat() if model.demand_at else None,
        }
        return Response(out(DemandOut, body))


class UnplacedOut(serializers.Serializer):
    count = serializers.IntegerField()
    reason = serializers.CharField()


class EngineNumbersOut(serializers.Serializer):
    tokens_per_second = serializers.FloatField(allow_null=True)
    busy_slots = serializers.IntegerField()
    slots = serializers.IntegerField()
    waiting = serializers.IntegerField(help_text="requests waiting for a free slot")
    predicted_tokens = serializers.IntegerField(help_text="tokens generated since it started")
    prompt_tokens = serializers.IntegerField(help_text="prompt tokens since it started")
    prompt_tokens_cached = serializers.IntegerField(
        help_text="of those, the ones its prompt cache served (no prefill)"
    )
    prompt_cache_hit_ratio = serializers.FloatField(
        allow_null=True, help_text="share of prompt tokens served from its prompt cache"
    )
    reported_at = serializers.DateTimeField()


class ReplicaOut(serializers.Serializer):
    id = serializers.CharField()
    node = serializers.CharField()
    profile = serializers.CharField()
    state = serializers.CharField()
    routable = serializers.BooleanField()
    up_to_date = serializers.BooleanField()
    port = serializers.IntegerField(allow_null=True)
    message = serializers.CharField(allow_blank=True)
    withdraw_reason = serializers.CharField(allow_blank=True)
    move_reason = serializers.CharField(
        allow_blank=True,
        help_text="why it is being moved to another node (it serves until its replacement is "
        "ready); empty when it is not",
    )
    generation = serializers.IntegerField(allow_null=True)
    weights_sha256 = serializers.CharField(allow_blank=True)
    revision = serializers.CharField(
        help_text="the files it serves, in short (fleet.specs.weights_revision): the weights' "
        "sha256's start, or a digest of them with their projector or snapshot files"
    )
    created_at = serializers.DateTimeField()
    slots = serializers.IntegerField(help_text="requests the replica serves at once")
    engine = EngineNumbersOut(
        allow_null=True, help_text="what the engine last reported; null when not recent"
    )
    devices = serializers.ListField(
        child=serializers.IntegerField(),
        help_text="the indices of its node's GPUs it was placed on; empty for a CPU replica",
    )


class TargetOut(serializers.Serializer):
    model = serializers.CharField()
    desired = serializers.IntegerField()
    why = serializers.CharField()
    class_ = serializers.CharField()
    ready = serializers.IntegerField()
    replicas = ReplicaOut(many=True)
    unplaced = UnplacedOut(many=True)
    rollout_halted = serializers.CharField(allow_null=True)
    generation = serializers.IntegerField()
    autoscale = serializers.DictField(
        allow_null=True,
        help_text="the autoscale policy and the autoscaler's last decision; null without one",
    )

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        fields["class"] = fields.pop("class_")
        return fields


class TargetAPI(APIView):
    @extend_schema(
        summary="What the reconciler aims for with a model, and why",
        responses=answers({200: TargetOut}, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        return Response(out(TargetOut, selectors.model_target(get_model(name))))


class PlacementOut(serializers.Serializer):
    node = serializers.CharField()
    profile = serializers.CharField()
    devices = serializers.ListField(
        child=serializers.IntegerField(),
        help_text="the node's GPUs (indices) the replica would hold; empty for a CPU profile",
    )
    gpu_memory_gb_per_device = serializers.FloatField(
        help_text="GPU memory it would reserve on each of them (its total split evenly)"
    )


class DeviceRoomOut(serializers.Serializer):
    node = serializers.CharField()
    index = serializers.IntegerField()
    total_gb = serializers.FloatField()
    reserved_gb = serializers.FloatField(help_text="reserved by llmgw's replicas")
    used_by_others_gb = serializers.FloatField(
        help_text="observed in use beyond llmgw's reservations: other programs'"
    )
    free_gb = serializers.FloatField(help_text="total - reserved - used by others")
    needed_gb = serializers.FloatField(help_text="what the replica needs on each of its GPUs")


class PlanUnplacedOut(UnplacedOut):
    devices = DeviceRoomOut(
        many=True,
        help_text=(
            "for a GPU profile short of device memory: the devices of the node that came "
            "closest, with their figures"
        ),
    )


class PreemptionOut(serializers.Serializer):
    model = serializers.CharField()
    node = serializers.CharField()
    reason = serializers.CharField()


class EstimateOut(serializers.Serializer):
    weights_gb = serializers.FloatField()
    kv_cache_gb = serializers.FloatField(help_text="for every slot")
    prompt_cache_gb = serializers.FloatField(help_text="the engine's store of earlier prompts")
    total_gb = serializers.FloatField()
    reserved_gb = serializers.FloatField(
        help_text=(
            "what placement reserves per replica in host memory: the larger of memory_gb and "
            "total_gb (for a GPU profile, and host_bytes instead of total_gb)"
        )
    )
    weights_bytes = serializers.IntegerField(help_text="the GB figures round a small model to 0")
    kv_cache_bytes = serializers.IntegerField()
    prompt_cache_bytes = serializers.IntegerField()
    total_bytes = serializers.IntegerField()
    context_length = serializers.IntegerField(allow_null=True)
    slots = serializers.IntegerField()
    gpus = serializers.IntegerField(help_text="GPUs of the first profile (0: a CPU profile)")
    gpu_layers = serializers.JSONField(help_text='the layers it offloads: "all" or a count')
    offloaded = serializers.FloatField(help_text="the share of the model's layers on its GPUs")
    gpu_bytes = serializers.IntegerField(
        help_text="of total_bytes, what its GPUs hold together (offloaded weights and KV cache)"
    )
    host_bytes = serializers.IntegerField(help_text="of total_bytes, what stays in host memory")
    gpu_reserved_gb_per_gpu = serializers.FloatField(
        help_text="what placement reserves on each GPU: the larger of gpu_memory_gb and the share"
    )


class PlanOut(serializers.Serializer):
    model = serializers.CharField()
    desired = serializers.IntegerField()
    placements = PlacementOut(many=True)
    preemptions = PreemptionOut(many=True)
    unplaced = PlanUnplacedOut(many=True)
    warnings = serializers.ListField(child=serializers.CharField())
    estimate = EstimateOut(allow_null=True, help_text="memory from the GGUF header, if read")


def _plan_view(model: Model, others: list[Model]) -> dict[str, Any]:
    # The header is read first, so that the plan reserves what placement will.
    facts = footprint.facts_for_plan(model)
    now = timezone.now()
    plan = selectors.simulate([*others, model], now)
    starts = [
        {
            "node": s.node,
            "profile": s.profile,
            "devices": list(s.devices),
            "gpu_memory_gb_per_device": round(s.gb_per_device, 3),
        }
        for s in plan.starts
        if s.model == model.name
    ]
    preempted = [{"model": p.model, "node": p.node, "reason": p.reason} for p in plan.preemptions]
    unplaced = [
        {
            "count": u.count,
            "reason": u.reason,
            "devices": [
                {
                    "node": d.node,
                    "index": d.index,
                    "total_gb": round(d.total_gb, 3),
                    "reserved_gb": round(d.reserved_gb, 3),
                    "used_by_others_gb": round(d.others_gb, 3),
                    "free_gb": round(d.free_gb, 3),
                    "needed_gb": round(d.needed_gb, 3),
                }
                for d in u.devices
            ],
        }
        for u in plan.unplaced
        if u.model == model.name
    ]
    result: dict[str, Any] = {
        "model": model.name,
        # The count the simulation placed: for an on-demand model nobody asked for lately, none.
        "desired": model.desired_replicas(now, current_config().default_idle_timeout),
        "placements": starts,
        "preemptions": preempted,
        "unplaced": unplaced,
        "warnings": [],
    }
    result.update(_memory_estimate(model, facts))
    return result


def _memory_estimate(model: Model, facts: footprint.FileFacts | str) -> dict[str, Any]:
    """Weights + KV cache from the GGUF header, against what each profile declares."""
    memories = footprint.model_footprints(model, facts)
    if isinstance(facts, str) or not memories:
        declared = ", ".join(f"{m.profile} {m.declared_gb:g} GB" for m in memories)
        return {
            "estimate": None,
            "warnings": [
                f"memory not estimated: {facts}; until it is, placement reserves what each "
                f"profile declares ({declared or 'no profile'})"
            ],
        }
    warnings = [
        f"profile {m.profile} declares {m.declared_gb:g} GB, below the estimated "
        f"{format_bytes(m.host_bytes)} ({m.host_words()}); placement reserves the estimate"
        for m in memories
        if m.estimate is not None and m.above_declared
    ]
    warnings += [
        f"profile {m.profile} declares gpu_memory_gb {m.declared_gpu_gb:g}, below the estimated "
        f"{format_bytes(m.gpu_bytes // m.gpus)} per GPU ({m.gpu_words()}); placement reserves "
        "the estimate"
        for m in memories
        if m.estimate is not None and m.gpu_above_declared
    ]
    # Each profile's replicas hold a KV cache per slot; the estimate shown is the first's.
    first = memories[0].estimate
    assert first is not None
    shown = memories[0]
    gib = 1024**3
    return {
        "estimate": {
            # GB figures compare with memory_gb; the byte counts keep a small model's size,
            # which rounds to 0 in GB.
            "weights_gb": round(first.weights_bytes / gib, 3),
            "kv_cache_gb": round(first.kv_cache_bytes / gib, 3),
            "prompt_cache_gb": round(first.prompt_cache_bytes / gib, 3),
            "total_gb": round(first.total_bytes / gib, 3),
            "reserved_gb": round(memories[0].memory_gb, 3),
            "weights_bytes": first.weights_bytes,
            "kv_cache_bytes": first.kv_cache_bytes,
            "prompt_cache_bytes": first.prompt_cache_bytes,
            "total_bytes": first.total_bytes,
            "context_length": first.context_length,
            "slots": first.slots,
            "gpus": shown.gpus,
            "gpu_layers": shown.gpu_layers,
            "offloaded": round(shown.offloaded, 4),
            "gpu_bytes": shown.gpu_bytes,
            "host_bytes": shown.host_bytes,
            "gpu_reserved_gb_per_gpu": round(shown.gpu_memory_gb_per_gpu, 3) if shown.gpus else 0,
        },
        "warnings": warnings,
    }


class PlanFileAPI(APIView):
    @extend_schema(
        summary="What adding or changing a model (its definition) would do; changes nothing",
        request={
            "application/json": ModelDefinitionSerializer,
            "application/yaml": ModelDefinitionSerializer,
        },
        responses=answers({200: PlanOut}, body=True),
    )
    def post(self, request: Request) -> Response:
        data = request.data
        definition = clean_definition(data, lines=getattr(data, "lines", None))
        others = [m for m in Model.objects.all() if m.name != definition["name"]]
        model = Model(name=definition["name"])
        apply_definition(model, definition)
        return Response(out(PlanOut, _plan_view(model, others)))


class PlanModelAPI(APIView):
    @extend_schema(
        summary="Where a model's replicas would go if placed afresh; changes nothing",
        responses=answers({200: PlanOut}, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        model = get_model(name)
        others = [m for m in Model.objects.all() if m.pk != model.pk]
        # Planned as a new model, so that where its replicas would go shows, not where they are.
        fresh = Model(name=model.name)
        apply_definition(fresh, model.definition())
        fresh.demand_at = model.demand_at
        return Response(out(PlanOut, _plan_view(fresh, others)))
