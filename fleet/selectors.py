"""Reads of the fleet: nodes with what is reserved and free, replicas per model, targets and plans."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db.models import Count, Sum
from django.utils import timezone

from catalog.config import current_config
from catalog.models import Model
from catalog.selectors import autoscale_view

from . import placement
from .footprint import FILE_FIELDS, Footprint, known_facts, model_footprints
from .models import Node, Replica
from .reconciler import (
    has_gpu_engine,
    model_demand,
    node_engines,
    node_gpu_engines,
    planner_node,
    planner_profile,
    planner_replica,
)
from .specs import current_keys, replica_revision


def _num(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(value, 2)


def nodes_view(*, addresses: bool, name: str | None = None) -> list[dict[str, Any]]:
    """Every node (or the one named) with what is reserved and free. A node's network address,
    allow-list and ports are shown only when `addresses` (to staff): they say where engines
    listen, which the gateway needs and people who only use models do not."""
    reserved = {
        row["node_id"]: row
        for row in Replica.objects.filter(withdrawn_at__isnull=True)
        .values("node_id")
        .annotate(
            memory=Sum("memory_gb"),
            cores=Sum("cores"),
            gpus=Sum("gpus"),
            gpu_memory=Sum("gpu_memory_gb"),
            count=Count("id"),
        )
    }
    names: dict[int, list[str]] = defaultdict(list)
    # GB llmgw reserved on each device of each node: a replica's GPU memory split evenly over
    # the devices it was placed on (as placement splits it).
    on_device: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for node_id, model_name, devices, gpu_memory in Replica.objects.filter(
        withdrawn_at__isnull=True
    ).values_list("node_id", "model_name", "devices", "gpu_memory_gb"):
        names[node_id].append(model_name)
        for index in devices or []:
            on_device[node_id][index] += (gpu_memory or 0) / len(devices)
    views = []
    nodes = Node.objects.all() if name is None else Node.objects.filter(name=name)
    for node in nodes:
        used: Any = reserved.get(node.pk, {})
        memory, cores = used.get("memory") or 0, used.get("cores") or 0
        gpus, gpu_memory = used.get("gpus") or 0, used.get("gpu_memory") or 0
        views.append(
            {
                "name": node.name,
                "state": node.state,
                "address": node.address if addresses else None,
                "capacity": {
                    "memory_gb": _num(node.memory_gb),
                    "cores": _num(node.cores),
                    "gpus": node.gpus,
                    "gpu_memory_gb": _num(node.gpu_memory_gb),
                },
                "reserved": {
                    "memory_gb": _num(memory),
                    "cores": _num(cores),
                    "gpus": gpus,
                    "gpu_memory_gb": _num(gpu_memory),
                },
                "free": {
                    "memory_gb": _num(node.memory_gb - memory),
                    "cores": _num(node.cores - cores),
                    "gpus": node.gpus - gpus,
                    "gpu_memory_gb": _num(node.gpu_memory_gb - gpu_memory),
                },
                "replicas": sorted(names.get(node.pk, [])),
                "last_heartbeat": node.last_heartbeat.isoformat() if node.last_heartbeat else None,
                "address_allow": list(node.address_allow) if addresses else None,
                "port_range": (
                    {"first": node.port_first, "last": node.port_last} if addresses else None
                ),
                "reported": node.reported_capacity or None,
                "warnings": node.capacity_notes(),
                "devices": device_views(node.devices or [], on_device.get(node.pk, {})),
                "devices_source": node.devices_source,
                "engine_backends": list(node.engine_backends or []),
                "engines": node_engines(node),
                "gpu_engines": node_gpu_engines(node),
            }
        )
    return views


MB_PER_GB = 1024


def device_views(devices: list[dict[str, Any]], reserved: dict[int, float]) -> list[dict[str, Any]]:
    """Each GPU's memory as placement counts it: reserved by llmgw's replicas, used by other
    programs (what is observed in use beyond llmgw's reservations), and free: the total less the
    larger of what llmgw reserved and what is observed in use (fleet.placement's rule)."""
    views = []
    for device in devices:
        total = device.get("memory_total_mb", 0) / MB_PER_GB
        used = device.get("memory_used_mb", 0) / MB_PER_GB
        ours = reserved.get(device.get("index", -1), 0.0)
        views.append(
            {
                "index": device.get("index"),
                "uuid": device.get("uuid", ""),
                "name": device.get("name", ""),
                "memory_total_gb": _num(total),
                "reserved_gb": _num(ours),
                "used_by_others_gb": _num(max(0.0, used - ours)),
                "used_gb": _num(used),
                "free_gb": _num(max(0.0, total - max(ours, used))),
                "utilization_pct": device.get("utilization_pct"),
            }
        )
    return views


def replica_view(replica: Replica, node_name: str, up_to_date: bool) -> dict[str, Any]:
    return {
        "id": str(replica.pk),
        "node": node_name,
        "profile": replica.profile,
        "state": replica.state if replica.withdrawn_at is None else "withdrawn",
        "routable": replica.routable,
        "up_to_date": up_to_date,
        "port": replica.port,
        "message": replica.message,
        "withdraw_reason": replica.withdraw_reason,
        "move_reason": replica.move_reason,
        "generation": replica.spec.get("generation"),
        "weights_sha256": replica.weights_sha256,
        "revision": replica_revision(replica.spec),
        "created_at": replica.created_at.isoformat(),
        "slots": replica.slots,
        "engine": engine_numbers(replica),
        "devices": list(replica.devices or []),
    }


# The engine's numbers are shown while fresh; an agent reads them every few seconds.
ENGINE_NUMBERS_FRESH_SECONDS = 30


def engine_numbers(replica: Replica) -> dict[str, Any] | None:
    """What the replica's engine last reported of itself (tokens/s, busy slots, prompt-cache
    hits), or None when it has not reported lately or is not serving."""
    if not replica.routable:
        return None
    return reported_numbers(
        replica.engine_metrics, replica.engine_metrics_at, replica.slots, timezone.now()
    )


def fresh_engine_rows() -> Iterable[tuple[UUID, str, str, Any, datetime | None, int]]:
    """(replica id, model name, node name, engine metrics, when reported, slots) of every
    serving replica whose engine reported within ENGINE_NUMBERS_FRESH_SECONDS: rows, not
    Replica instances (the gateway's /metrics reads them, and at 20,000 replicas their
    instances cost a second of its CPU a read)."""
    since = timezone.now() - timedelta(seconds=ENGINE_NUMBERS_FRESH_SECONDS)
    return (
        Replica.objects.filter(
            withdrawn_at__isnull=True,
            state=Replica.READY,
            model__isnull=False,
            engine_metrics_at__gte=since,
        )
        .order_by("model_name", "id")
        .values_list(
            "id", "model_name", "node__name", "engine_metrics", "engine_metrics_at", "slots"
        )
    )


def reported_numbers(
    numbers: dict[str, Any] | None, at: datetime | None, slots: int, now: datetime
) -> dict[str, Any] | None:
    """engine_numbers of a serving replica's fields: None when its engine has not reported
    within ENGINE_NUMBERS_FRESH_SECONDS of `now`."""
    if not numbers or at is None:
        return None
    if (now - at).total_seconds() > ENGINE_NUMBERS_FRESH_SECONDS:
        return None
    prompt = numbers.get("prompt_tokens", 0) + numbers.get("prompt_tokens_cached", 0)
    return {
        "tokens_per_second": numbers.get("tokens_per_second"),
        "busy_slots": int(numbers.get("requests_processing", 0)),
        "slots": slots,
        "waiting": int(numbers.get("requests_deferred", 0)),
        "predicted_tokens": int(numbers.get("predicted_tokens", 0)),
        "prompt_tokens": int(prompt),
        "prompt_tokens_cached": int(numbers.get("prompt_tokens_cached", 0)),
        "prompt_cache_hit_ratio": (
            round(numbers.get("prompt_tokens_cached", 0) / prompt, 3) if prompt else None
        ),
        "reported_at": at.isoformat(),
    }


def node_engine_numbers() -> dict[int, dict[str, Any]]:
    """Per node: its serving replicas' engine numbers added up."""
    totals: dict[int, dict[str, Any]] = {}
    for replica in Replica.objects.filter(withdrawn_at__isnull=True, state=Replica.READY):
        numbers = engine_numbers(replica)
        if numbers is None:
            continue
        node = totals.setdefault(
            replica.node_id,
            {"tokens_per_second": 0.0, "busy_slots": 0, "slots": 0, "prompt": 0, "cached": 0},
        )
        node["tokens_per_second"] += numbers["tokens_per_second"] or 0
        node["busy_slots"] += numbers["busy_slots"]
        node["slots"] += numbers["slots"]
        node["prompt"] += numbers["prompt_tokens"]
        node["cached"] += round((numbers["prompt_cache_hit_ratio"] or 0) * numbers["prompt_tokens"])
    for node in totals.values():
        node["tokens_per_second"] = round(node["tokens_per_second"], 1)
        node["prompt_cache_hit_ratio"] = (
            round(node.pop("cached") / node["prompt"], 3) if node["prompt"] else None
        )
        del node["prompt"]
    return totals


def model_status(models: list[Model]) -> dict[int, dict[str, int]]:
    """Ready and desired replicas per model, in two queries whatever the number of models."""
    now = timezone.now()
    default_idle = current_config().default_idle_timeout
    ready = dict(
        Replica.objects.filter(withdrawn_at__isnull=True, state=Replica.READY, model__isnull=False)
        .values_list("model_id")
        .annotate(n=Count("id"))
    )
    running = dict(
        Replica.objects.filter(withdrawn_at__isnull=True, model__isnull=False)
        .values_list("model_id")
        .annotate(n=Count("id"))
    )
    return {
        m.pk: {
            "ready": ready.get(m.pk, 0),
            "replicas": running.get(m.pk, 0),
            "desired": m.desired_replicas(now, default_idle),
        }
        for m in models
    }


def simulate(models: list[Model], now: datetime | None = None) -> placement.Plan:
    """What a pass would do with these models (changed or added ones included), writing nothing."""
    now = now or timezone.now()
    default_idle = current_config().default_idle_timeout
    nodes = list(Node.objects.all())
    node_names = {n.pk: n.name for n in nodes}
    known = {m.pk for m in models if m.pk}
    active = [
        r
        for r in Replica.objects.filter(withdrawn_at__isnull=True).exclude(state=Replica.FAILED)
        if r.model_id is None or r.model_id in known
    ]
    facts = known_facts(models)
    demands = [
        model_demand(m, m.desired_replicas(now, default_idle), facts[m.name]) for m in models
    ]
    return placement.plan_placement(
        [planner_node(n) for n in nodes], demands, [planner_replica(r, node_names) for r in active]
    )


def model_target(model: Model) -> dict[str, Any]:
    """What the reconciler aims for with one model, and why any wanted replica is not placed."""
    now = timezone.now()
    config = current_config()
    desired = model.desired_replicas(now, config.default_idle_timeout)
    keys = current_keys(model)
    node_names = dict(Node.objects.values_list("pk", "name"))
    replicas = list(Replica.objects.filter(model=model).order_by("created_at"))
    views = [
        replica_view(r, node_names.get(r.node_id, "?"), r.spec_key == keys.get(r.profile))
        for r in replicas
    ]
    plan = simulate(list(Model.objects.all()))
    unplaced = [u.reason for u in plan.unplaced if u.model == model.name]
    count = sum(u.count for u in plan.unplaced if u.model == model.name)
    if model.parked:
        why = "min 0, max 0: kept in the catalog, deliberately not running"
    elif model.on_demand:
        why = f"on demand: {'asked for within the idle timeout' if desired else 'not asked for within the idle timeout'}"
    else:
        why = f"min_replicas is {model.min_replicas}"
    if model.autoscale and desired:
        why = f"autoscaled: {(model.autoscale_state or {}).get('why') or 'no decision yet'}"
    return {
        "model": model.name,
        "desired": desired,
        "why": why,
        "class": model.class_in_force,
        "ready": sum(1 for v in views if v["routable"]),
        "replicas": views,
        "unplaced": [{"count": count, "reason": reason} for reason in unplaced],
        "rollout_halted": model.rollout_halted or None,
        "generation": model.generation,
        "autoscale": autoscale_view(model),
    }


# -- whether an on-demand model fits on any node (the gateway asks before waking one) ----------


def unplaceable_models(
    names: Iterable[str], *, node_fields: Sequence[str], model_fields: Sequence[str]
) -> dict[str, str]:
    """The models of `names` none of whose profiles fits on any schedulable node, even an empty
    one, each with why, in words for the person who asked for it.

    Whether a profile fits is the planner's rule (fleet.placement.fits_on_empty), asked of what
    the planner itself would reserve (fleet.reconciler.planner_profile): the gateway must not
    refuse a model the reconciler would place, nor wake one it cannot. Only `node_fields` and
    `model_fields` are read: the caller's, which its triggers watch (access.routed's
    NODE_PLACING, MODEL_PLACING; a field left out would be loaded row by row)."""
    names = list(names)
    if not names:
        return {}
    nodes = [n for n in Node.objects.order_by().only(*node_fields) if n.schedulable]
    planned = [_as_placed(n) for n in nodes]
    why: dict[str, str] = {}
    # The projector's fields too (footprint.FILE_FIELDS): they change only with the source,
    # which the caller's triggers watch.
    fields = dict.fromkeys([*model_fields, *FILE_FIELDS])
    models = list(Model.objects.order_by().filter(name__in=names).only(*fields))
    facts = known_facts(models)
    for model in models:
        name = model.name
        if not nodes:
            why[name] = (
                "no node is ready to run it (none has sent a heartbeat, or all are cordoned or lost)"
            )
            continue
        engine = model.engine_name
        with_engine = [node for node in planned if node.engines is None or engine in node.engines]
        if not with_engine:
            why[name] = (
                f"no node that is ready has its engine, {engine}: install it on a node and "
                "restart that node's agent"
            )
            continue
        profiles = list(zip(model.profiles, model_footprints(model, facts[name]), strict=True))
        needs = [planner_profile(profile, memory).resources for profile, memory in profiles]
        if any(
            placement.fits_on_empty(need, node, engine) for need in needs for node in with_engine
        ):
            continue
        largest = max(nodes, key=lambda n: (n.memory_gb, n.cores))
        described = "; ".join(_describe(p, memory) for p, memory in profiles) or "no profile"
        why[name] = (
            f"it fits on no node: its profiles need {described}, and the largest node has "
            f"{largest.memory_gb:g} GB and {largest.cores:g} cores"
            + (f", {largest.gpus} GPUs" if largest.gpus else "")
            + _gpu_engine_words(profiles, planned)
        )
    return why


def _as_placed(node: Node) -> placement.Node:
    """A node as the planner sees it, with its GPUs as many as it has of the memory its agent
    reports for each (the smallest GPU's): Node.devices is not read, as the memory in use in it
    moves with every heartbeat and the gateway would read everything again each time. A node
    of GPUs of different sizes may so be thought too small for a model its biggest GPU holds."""
    devices = tuple(placement.Device(i, float(node.gpu_memory_gb)) for i in range(node.gpus))
    return placement.Node(
        name=str(node.pk),  # its name is not read (nor watched): only a key is needed
        capacity=placement.Resources(node.memory_gb, node.cores, node.gpus, node.gpu_memory_gb),
        schedulable=True,
        devices=devices,
        gpu_engine=has_gpu_engine(node),
        engines=frozenset(node_engines(node)),
        gpu_engines=frozenset(node_gpu_engines(node)),
    )


def _gpu_engine_words(
    profiles: list[tuple[dict[str, Any], Footprint]], nodes: list[placement.Node]
) -> str:
    if any(p.get("gpus") for p, _ in profiles) and not any(n.gpu_engine for n in nodes):
        return (
            "; and no node's engine has a GPU backend (build it with LLMGW_ENGINE=cuda make "
            "setup on a machine with NVIDIA GPUs)"
        )
    return ""


def _describe(profile: dict[str, Any], memory: Footprint) -> str:
    cores = float(profile.get("cores") or 0)
    text = f"{profile.get('name', '?')}: {memory.memory_gb:g} GB, {cores:g} cores"
    if profile.get("gpus"):
        text += f", {profile['gpus']} GPUs"
    return text
