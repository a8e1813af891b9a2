"""Writes to the fleet: nodes added, removed, cordoned, and what their agents report."""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from catalog.errors import CatalogError, conflict, forbidden
from catalog.services import Actor

from .models import Node, Replica, hash_token
from .signals import fleet_changed

# A withdrawn replica that was serving stays on its node this long, so that
# requests already sent to it can finish before the engine stops.
DRAIN_SECONDS = 5
NODE_NAME_MAX = 100


def _require_staff(actor: Actor, what: str) -> None:
    if not actor.is_staff:
        raise forbidden(f"Only staff may {what}; ask an administrator.")


def _get_node(name: str) -> Node:
    try:
        return Node.objects.get(name=name)
    except Node.DoesNotExist:
        known = ", ".join(Node.objects.values_list("name", flat=True)) or "none yet"
        raise CatalogError(
            f"There is no node named {name!r} (nodes: {known}).", code="not_found", status=404
        ) from None


def node_add(*, actor: Actor, name: str) -> tuple[Node, str]:
    """Register a node; returns it and its token, which is shown only this once."""
    _require_staff(actor, "add nodes")
    from catalog.definitions import NAME_PATTERN

    if not name or len(name) > NODE_NAME_MAX or not NAME_PATTERN.fullmatch(name):
        raise CatalogError(
            f"{name!r} is not a node name: use up to {NODE_NAME_MAX} letters, digits, '.', '_', '-' "
            "and ':', starting with a letter or digit (the name is part of URLs).",
            code="invalid",
        )
    token = "llmgw-node-" + secrets.token_urlsafe(32)
    with transaction.atomic():
        if Node.objects.filter(name=name).exists():
            raise conflict(
                f"A node named {name} already exists; remove it first to issue a new token.",
                code="name_taken",
            )
        node = Node.objects.create(name=name, token_hash=hash_token(token))
    return node, token


def node_remove(*, actor: Actor, name: str) -> None:
    """Forget a node; its replicas are placed elsewhere on the next pass."""
    _require_staff(actor, "remove nodes")
    with transaction.atomic():
        _get_node(name).delete()
        transaction.on_commit(lambda: fleet_changed.send(sender=Node))


def node_cordon(*, actor: Actor, name: str, cordoned: bool) -> Node:
    """A cordoned node keeps what it runs but gets no new replicas."""
    _require_staff(actor, "cordon nodes")
    with transaction.atomic():
        node = _get_node(name)
        node.cordoned = cordoned
        node.save(update_fields=["cordoned"])
        transaction.on_commit(lambda: fleet_changed.send(sender=Node))
    return node


def authenticate_node(token: str) -> Node | None:
    return Node.objects.filter(token_hash=hash_token(token)).first()


def replica_order(replica: Replica) -> dict[str, Any]:
    """What the node is told to run for one replica."""
    spec = replica.spec
    cores = spec.get("resources", {}).get("cores") or 0
    return {
        "id": str(replica.pk),
        "model": replica.model_name,
        "source": spec["source"],
        "sha256": spec.get("sha256"),
        "adapters": spec.get("adapters", []),
        "context_length": spec.get("context_length"),
        "threads": max(1, int(cores)) if cores else None,
        "slots": replica.slots,
    }


REPORTED_STATES = {Replica.FETCHING, Replica.STARTING, Replica.READY, Replica.FAILED}


def node_heartbeat(*, node: Node, report: dict[str, Any], interval: int) -> dict[str, Any]:
    """Record what the node reports; answer with everything it should run (level-triggered)."""
    now = timezone.now()
    settled = False  # a replica became ready or failed: the reconciler should look now
    with transaction.atomic():
        capacity = report["capacity"]
        node.memory_gb = capacity["memory_gb"]
        node.cores = capacity["cores"]
        node.gpus = capacity["gpus"]
        node.gpu_memory_gb = capacity["gpu_memory_gb"]
        node.address = report.get("address") or node.address
        node.agent = report.get("agent") or {}
        node.last_heartbeat = now
        came_back = node.lost
        node.lost = False
        node.save()

        reported = {r["id"]: r for r in report.get("replicas", [])}
        changed, gone, wanted = [], [], []
        for replica in Replica.objects.filter(node=node).order_by("created_at"):
            seen = reported.get(str(replica.pk))
            draining = (
                replica.withdrawn_at is not None
                and replica.state == Replica.READY
                and now < replica.withdrawn_at + timedelta(seconds=DRAIN_SECONDS)
            )
            if replica.withdrawn_at is None or draining:
                wanted.append(replica)
            elif seen is None:
                gone.append(replica.pk)  # withdrawn and stopped: nothing left to track
                continue
            if seen is not None and _update_replica(replica, seen, now):
                changed.append(replica)
                settled = settled or replica.state in (Replica.READY, Replica.FAILED)
        if changed:
            Replica.objects.bulk_update(
                changed,
                [
                    "state",
                    "message",
                    "port",
                    "weights_sha256",
                    "ready_at",
                    "state_changed_at",
                    "engine_metrics",
                    "engine_metrics_at",
                ],
            )
        if gone:
            Replica.objects.filter(pk__in=gone).delete()
        if settled or came_back:
            transaction.on_commit(lambda: fleet_changed.send(sender=Node))
    return {
        "node": node.name,
        "heartbeat_interval": interval,
        "replicas": [replica_order(r) for r in wanted],
        "keep": _previous_revisions({r.model_id for r in wanted if r.model_id is not None}),
    }


def _previous_revisions(model_ids: set[int]) -> list[dict[str, Any]]:
    """The weights a rollback of these models would start again: the node keeps them cached
    even when its cache is full (llmgw node --cache-max-gb)."""
    from catalog.models import Model

    if not model_ids:
        return []
    previous = Model.objects.filter(pk__in=model_ids, previous__isnull=False).values_list(
        "previous", flat=True
    )
    return [
        {"source": p["source"], "sha256": p.get("sha256") or None}
        for p in previous
        if isinstance(p, dict) and p.get("source")
    ]


def _update_replica(replica: Replica, seen: dict[str, Any], now: Any) -> bool:
    state = seen["state"]
    if state not in REPORTED_STATES:
        return False
    before = (replica.state, replica.message, replica.port, replica.weights_sha256)
    if state != replica.state:
        replica.state_changed_at = now
        if state == Replica.READY:
            replica.ready_at = now
    replica.state = state
    replica.message = (seen.get("message") or "")[:4000]
    replica.port = seen.get("port")
    replica.weights_sha256 = seen.get("sha256") or replica.weights_sha256
    numbers = seen.get("engine")
    metrics_changed = bool(numbers) and numbers != replica.engine_metrics
    if metrics_changed:
        replica.engine_metrics = numbers
        replica.engine_metrics_at = now
    changed = before != (replica.state, replica.message, replica.port, replica.weights_sha256)
    return changed or metrics_changed
