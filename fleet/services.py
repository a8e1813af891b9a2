"""Writes to the fleet: nodes added, removed, cordoned, and what their agents report."""

from __future__ import annotations

import logging
import math
import socket
import time
from datetime import datetime, timedelta
from typing import Any, NamedTuple, cast
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Field, QuerySet
from django.utils import timezone

from catalog.config import current_config
from catalog.definitions import NAME_PATTERN
from catalog.models import projector_of, repository_file
from core.actor import Actor, require_staff
from core.refusals import Refused, conflict
from llmgw.bearer import NODE_TOKEN
from llmgw.engines import engine_names

from . import trust
from .liveness import Liveness
from .models import (
    REMOVED_NODE_KEPT,
    Node,
    RemovedNode,
    Replica,
    bump_generation,
    hash_token,
)
from .signals import fleet_changed, replica_state_changed
from .specs import engine_key, gpu_order

log = logging.getLogger("llmgw.fleet")

# A withdrawn replica that was serving stays on its node this long, so that
# requests already sent to it can finish before the engine stops.
DRAIN_SECONDS = 5
NODE_NAME_MAX = 100


def _get_node(name: str) -> Node:
    try:
        return Node.objects.get(name=name)
    except Node.DoesNotExist:
        known = ", ".join(Node.objects.values_list("name", flat=True)) or "none yet"
        raise Refused(
            f"There is no node named {name!r} (nodes: {known}).", code="not_found", status=404
        ) from None


def _address_allow(entries: list[str]) -> list[str]:
    try:
        return trust.parse_networks(entries)
    except ValueError as error:
        raise Refused(
            f"The address allow-list was refused: {error}. List the networks (CIDR) or "
            "addresses the node may report as its engines' address, comma-separated.",
            code="address_allow_invalid",
        ) from None


def node_add(
    *, actor: Actor, name: str, address_allow: list[str] | None = None
) -> tuple[Node, str]:
    """Register a node; returns it and its token, which is shown only this once.

    `address_allow`: networks the node may report as its engines' address besides the one it
    connects from (fleet.trust, rule 1)."""
    require_staff(actor, "add nodes")
    networks = _address_allow(address_allow or [])

    if not name or len(name) > NODE_NAME_MAX or not NAME_PATTERN.fullmatch(name):
        raise Refused(
            f"{name!r} is not a node name: use up to {NODE_NAME_MAX} letters, digits, '.', '_', '-' "
            "and ':', starting with a letter or digit (the name is part of URLs).",
            code="invalid",
        )
    token = NODE_TOKEN.new()
    with transaction.atomic():
        if Node.objects.filter(name=name).exists():
            raise conflict(
                f"A node named {name} already exists; remove it first to issue a new token.",
                code="name_taken",
            )
        node = Node.objects.create(name=name, token_hash=hash_token(token), address_allow=networks)
    return node, token


def node_set(*, actor: Actor, name: str, address_allow: list[str]) -> Node:
    """Replace the networks a node may report as its engines' address; its next heartbeat is
    checked against them (an address it reports now and no longer may is refused then)."""
    require_staff(actor, "change nodes")
    networks = _address_allow(address_allow)
    with transaction.atomic():
        node = _get_node(name)
        node.address_allow = networks
        node.save(update_fields=["address_allow"])
    return node


def node_accept_capacity(*, actor: Actor, name: str) -> Node:
    """Believe the capacity a node last reported, as if it had first registered with it: what
    staff do after giving a machine more memory, cores or GPUs (fleet.trust, rule 3)."""
    require_staff(actor, "accept a node's capacity")
    with transaction.atomic():
        node = _get_node(name)
        if not node.reported_capacity:
            raise conflict(
                f"Node {name} has not reported its capacity yet; start its agent first.",
                code="nothing_reported",
            )
        reported = trust.Capacity.from_json(node.reported_capacity)
        node.registered_capacity = reported.as_json()
        node.memory_gb, node.cores = reported.memory_gb, reported.cores
        node.gpus, node.gpu_memory_gb = reported.gpus, reported.gpu_memory_gb
        node.save(
            update_fields=["registered_capacity", "memory_gb", "cores", "gpus", "gpu_memory_gb"]
        )
        bump_generation([node.pk])  # its warnings change
        transaction.on_commit(lambda: fleet_changed.send(sender=Node))
    return node


def node_remove(*, actor: Actor, name: str) -> None:
    """Forget a node; its replicas are placed elsewhere on the next pass. Its token is
    remembered (RemovedNode) so that its agent is told who removed it, and stops its engines."""
    require_staff(actor, "remove nodes")
    with transaction.atomic():
        node = _get_node(name)
        # Deleted by a filter that says whether it deleted: of two removals at once, the one
        # that finds the row already gone says so, as if it had come a moment later.
        _, deleted = Node.objects.filter(pk=node.pk).delete()
        if not deleted.get(Node._meta.label):
            _get_node(name)  # gone: refused as not found (the other removal recorded it)
            return  # added again meanwhile: not this removal's node
        now = timezone.now()
        RemovedNode.objects.filter(removed_at__lt=now - REMOVED_NODE_KEPT).delete()
        RemovedNode.objects.update_or_create(
            token_hash=node.token_hash,
            defaults={
                "name": node.name,
                "removed_by": actor.name,
                "door": actor.door,
                "removed_at": now,
            },
        )
        transaction.on_commit(lambda: fleet_changed.send(sender=Node))


def node_cordon(*, actor: Actor, name: str, cordoned: bool) -> Node:
    """A cordoned node keeps what it runs but gets no new replicas."""
    require_staff(actor, "cordon nodes")
    with transaction.atomic():
        node = _get_node(name)
        node.cordoned = cordoned
        node.save(update_fields=["cordoned"])
        transaction.on_commit(lambda: fleet_changed.send(sender=Node))
    return node


def authenticate_node(token: str) -> Node | None:
    # token_hash is unique: no ORDER BY to build (first() would add one), at every node request.
    return next(iter(Node.objects.filter(token_hash=hash_token(token))[:1]), None)


def removed_node(token: str) -> RemovedNode | None:
    """The removal of the node whose token this was, if it was removed lately: asked only of a
    token no node has, so a known node's request costs nothing more."""
    return next(iter(RemovedNode.objects.filter(token_hash=hash_token(token))[:1]), None)


def replica_order(replica: Replica, node: Node | None = None) -> dict[str, Any]:
    """What the node is told to run for one replica. ``node``, when given, is the replica's
    (saves a query per GPU replica: its devices' UUIDs are read from the node)."""
    spec = replica.spec
    cores = spec.get("resources", {}).get("cores") or 0
    devices = [i for i in replica.devices or [] if isinstance(i, int)]
    node_devices = ((node or replica.node).devices or []) if devices else []
    return {
        "id": str(replica.pk),
        "model": replica.model_name,
        "source": spec["source"],
        "sha256": spec.get("sha256"),
        "adapters": spec.get("adapters", []),
        # The vision projector, of the weights' revision; left out for a text model, so that
        # an agent from before projectors is told nothing new.
        **({"mmproj": spec["mmproj"]} if spec.get("mmproj") else {}),
        # Likewise for a reranker, a model of another engine than the default, and a snapshot's
        # other files: left out where the spec has none.
        **({"reranking": True} if spec.get("reranking") else {}),
        **({"engine": spec["engine"]} if spec.get("engine") else {}),
        **({"files": spec["files"]} if spec.get("files") else {}),
        "context_length": spec.get("context_length"),
        "threads": max(1, int(cores)) if cores else None,
        "slots": replica.slots,
        "engine_key": engine_key(str(replica.pk)),
        **gpu_order(spec, devices, node_devices, float(replica.gpu_memory_gb or 0)),
    }


REPORTED_STATES = {Replica.FETCHING, Replica.STARTING, Replica.READY, Replica.FAILED}
# What a node's report changes of a replica (_update_replica).
REPORTED_FIELDS = (
    "state",
    "message",
    "port",
    "weights_sha256",
    "ready_at",
    "state_changed_at",
    "engine_metrics",
    "engine_metrics_at",
)


def _untrusted(error: trust.Untrusted) -> Refused:
    # An address the node may not claim is a matter of rights; the other refusals are bad input.
    status = 403 if error.code.startswith("address") else 400
    return Refused(error.message, code=error.code, status=status)


def _limits() -> trust.Capacity:
    return trust.Capacity(
        memory_gb=settings.LLMGW_NODE_MAX_MEMORY_GB,
        cores=settings.LLMGW_NODE_MAX_CORES,
        gpus=settings.LLMGW_NODE_MAX_GPUS,
        gpu_memory_gb=settings.LLMGW_NODE_MAX_GPU_MEMORY_GB,
    )


def _on_this_machine(ip: trust.IPAddress) -> bool:
    """Whether `ip` is an address of this machine: a socket binds to it only then (nothing is
    sent anywhere)."""
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


def _own_ports(address: str) -> set[int]:
    """Ports of the control plane on the node's machine, which no replica may claim: a replica
    "on" the gateway's own port would have the gateway send requests to itself."""
    ip = trust.parse_ip(address)
    if ip is None or not ip.is_loopback:
        return set()
    public = urlsplit(settings.LLMGW_PUBLIC_URL)
    return {public.port or (443 if public.scheme == "https" else 80)}


def node_heartbeat(
    *, node: Node, report: dict[str, Any], interval: int, peer: str | None = None
) -> dict[str, Any]:
    """Record what the node reports; answer with everything it should run (level-triggered).

    `peer` is the address the heartbeat came from; the reported address is checked against it
    (fleet.trust). None for callers inside the control plane, which have no connection: their
    report's address is taken as given. A report that is not believed is refused whole
    (Refused) and changes nothing.
    """
    now = timezone.now()
    believed = _believed_report(node, report, peer)
    with transaction.atomic():
        came_back = _record_node(node, report, believed, now)
        wanted, settled = _record_replicas(node, report, believed.ports, now)
        if settled or came_back:
            transaction.on_commit(lambda: fleet_changed.send(sender=Node))
    return {
        "node": node.name,
        "heartbeat_interval": interval,
        **_orders(node, wanted, now),
    }


class _Believed(NamedTuple):
    """What of a node's report the control plane takes (fleet.trust)."""

    address: str
    ports: _Ports
    offered: trust.Capacity
    registered: trust.Capacity
    capacity: trust.Capacity
    first_report: bool


def _believed_report(node: Node, report: dict[str, Any], peer: str | None) -> _Believed:
    """The report's address, ports and capacity as believed, or Refused when it may not claim
    them."""
    offered = trust.Capacity.from_json(report["capacity"])
    try:
        if peer is None:
            address = report.get("address") or node.address
        else:
            address = trust.engine_address(
                reported=report.get("address") or "",
                peer=peer,
                allowed=list(node.address_allow or []),
                node=node.name,
                on_this_machine=_on_this_machine,
            )
        first_port, last_port = trust.port_range(
            declared=report.get("port_range"),
            bounds=(settings.LLMGW_NODE_PORT_MIN, settings.LLMGW_NODE_PORT_MAX),
        )
        trust.check_limits(offered, _limits())
    except trust.Untrusted as error:
        raise _untrusted(error) from None
    first_report = node.registered_capacity is None
    registered = (
        offered if first_report else trust.Capacity.from_json(node.registered_capacity or {})
    )
    capacity, _ = trust.believed(offered, registered)
    ports = _Ports(first_port, last_port, _own_ports(address))
    return _Believed(address, ports, offered, registered, capacity, first_report)


def _record_node(node: Node, report: dict[str, Any], believed: _Believed, now: datetime) -> bool:
    """Write what the heartbeat reports of the node itself; whether it came back from lost.
    Refused when the node was removed meanwhile."""
    capacity = believed.capacity
    node.memory_gb = capacity.memory_gb
    node.cores = capacity.cores
    node.gpus = capacity.gpus
    node.gpu_memory_gb = capacity.gpu_memory_gb
    node.registered_capacity = believed.registered.as_json()
    node.reported_capacity = believed.offered.as_json()
    node.address = believed.address
    node.port_first, node.port_last = believed.ports.first, believed.ports.last
    node.agent = report.get("agent") or {}
    # The devices believed are as many as the GPUs believed (fleet.trust): a node that
    # reports more than it registered gets placements on its first ones only.
    node.devices = list(report.get("devices") or [])[: capacity.gpus]
    node.devices_source = report.get("devices_source") or ""
    node.engine_backends = list(report.get("engine_backends") or [])
    # Only names llmgw knows: a report is hostile until checked, and placement matches by name.
    node.engines = [e for e in report.get("engines") or [] if e in engine_names()]
    node.gpu_engines = [e for e in report.get("gpu_engines") or [] if e in node.engines]
    node.report_digest = report.get("report_digest") or ""
    node.heard_since = node.heard_since_with(now, lost_after=current_config().node_lost_after)
    node.last_heartbeat = now
    came_back = node.lost
    node.lost = False
    # Only what the heartbeat reports: staff may have cordoned the node, changed its
    # allow-list or accepted its capacity since it was read, and that must not be undone.
    written = ["memory_gb", "cores", "gpus", "gpu_memory_gb", "reported_capacity"]
    written += ["address", "port_first", "port_last", "agent", "last_heartbeat", "lost"]
    written += ["devices", "devices_source", "engine_backends", "engines", "gpu_engines"]
    written.append("report_digest")
    written.append("heard_since")
    if believed.first_report:
        written.append("registered_capacity")
    if not Node.objects.filter(pk=node.pk).update(**{f: getattr(node, f) for f in written}):
        raise Refused(
            f"Node {node.name} was removed; register it again and restart its agent with "
            "the new token.",
            code="not_found",
            status=404,
        )
    return came_back


def _record_replicas(
    node: Node, report: dict[str, Any], ports: _Ports, now: datetime
) -> tuple[list[Replica], bool]:
    """Write the states the node reports of its replicas, and forget those withdrawn and
    stopped; the replicas it should run, and whether one became ready or failed (the
    reconciler should look now)."""
    reported = {r["id"]: r for r in report.get("replicas", [])}
    settled = False
    changed, gone, wanted = [], [], []
    for replica in _node_replicas(node):
        seen = reported.get(str(replica.pk))
        if _wanted(replica, now):
            wanted.append(replica)
        elif seen is None:
            gone.append(replica.pk)  # withdrawn and stopped: nothing left to track
            continue
        if seen is not None and _update_replica(replica, seen, now, ports):
            changed.append(replica)
            settled = settled or replica.state in (Replica.READY, Replica.FAILED)
    _write_reported(changed)
    if gone:
        Replica.objects.filter(pk__in=gone).delete()
    return wanted, settled


def _write_reported(replicas: list[Replica]) -> None:
    """Write what a report changed of these replicas (REPORTED_FIELDS).

    On PostgreSQL one UPDATE from a VALUES list, each row cast to its column's type: building
    Django's UPDATE took about 0.7 ms of the web's CPU a replica, and a report of 4 replicas
    turning ready (5,000 of them within a minute or two when a model of thousands is placed)
    spent a third of its CPU there. bulk_update was worse (its CASE WHEN a row and a field, 60 %
    of such a report's CPU). Elsewhere, one UPDATE a replica."""
    if not replicas:
        return
    if connection.vendor != "postgresql" or len(replicas) == 1:
        for replica in replicas:
            Replica.objects.filter(pk=replica.pk).update(
                **{field: getattr(replica, field) for field in REPORTED_FIELDS}
            )
        return
    meta = Replica._meta
    fields = [cast("Field[Any, Any]", meta.get_field(name)) for name in REPORTED_FIELDS]
    columns = [cast("Field[Any, Any]", meta.pk), *fields]
    quote = connection.ops.quote_name
    names = [quote(str(c.column)) for c in columns]  # the key first
    row = "(" + ", ".join(f"%s::{c.db_type(connection)}" for c in columns) + ")"
    sql = (
        f"UPDATE {quote(meta.db_table)} AS replica SET "
        + ", ".join(f"{name} = reported.{name}" for name in names[1:])
        + f" FROM (VALUES {', '.join([row] * len(replicas))}) AS reported({', '.join(names)})"
        + f" WHERE replica.{names[0]} = reported.{names[0]}"
    )
    values = [
        column.get_db_prep_value(getattr(replica, column.attname), connection)
        for replica in replicas
        for column in columns
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, values)


# A withdrawal stamped later than now by more than this was stamped before this clock stepped
# back (or by a machine whose clock is ahead): its drain cannot be measured, and it is over.
DRAIN_CLOCK_SLACK = timedelta(seconds=60)


def _wanted(replica: Replica, now: Any) -> bool:
    """Whether the node should run it: not withdrawn, or withdrawn while serving and still
    draining (requests sent to it finish before its engine stops). A withdrawal stamped well
    after now ends its drain (DRAIN_CLOCK_SLACK): measured from it, a clock stepped back five
    minutes kept every replica withdrawn before the step running for five minutes more."""
    withdrawn = replica.withdrawn_at
    if withdrawn is None:
        return True
    if withdrawn > now + DRAIN_CLOCK_SLACK:
        return False
    return replica.state == Replica.READY and now < withdrawn + timedelta(seconds=DRAIN_SECONDS)


def _orders(node: Node, wanted: list[Replica], now: Any) -> dict[str, Any]:
    """What a node is told to run, with the generation it was read at (`node` as loaded before
    its replicas were, so that a change committed in between makes the generation older, never
    newer, than what is sent). No generation while a replica drains: when its drain ends the
    answer changes without a write, so the node is answered in full until then."""
    draining = any(r.withdrawn_at is not None for r in wanted)
    return {
        "generation": None if draining else node.generation,
        "replicas": [replica_order(r, node) for r in wanted],
        "keep": _previous_revisions(wanted),
        "warnings": node.capacity_notes(),
    }


# The heartbeat interval the control plane asks for grows with the fleet, so that the heartbeats
# of a large one cost what a few hundred nodes' do: 2 s up to NODES_PER_SECOND x 2 nodes, then one
# heartbeat a second per NODES_PER_SECOND nodes, and never above a third of node_lost_after (a
# node is lost only after three missed heartbeats). A replica's change is still reported at once.
HEARTBEAT_SECONDS = 2
NODES_PER_SECOND = 250
FLEET_COUNT_SECONDS = 30.0


def interval_for(nodes: int, lost_after: float) -> int:
    """Seconds between a node's heartbeats in a fleet of `nodes` (see NODES_PER_SECOND)."""
    ceiling = max(HEARTBEAT_SECONDS, int(lost_after // 3))
    return max(HEARTBEAT_SECONDS, min(ceiling, math.ceil(nodes / NODES_PER_SECOND)))


class FleetSize:
    """The number of nodes, counted again at most every FLEET_COUNT_SECONDS: one per web process,
    made with the fleet app (fleet.apps), which answers the nodes' heartbeats and renewals."""

    def __init__(self, nodes: int = 0, counted_at: float | None = None) -> None:
        self.nodes = nodes
        self.counted_at = counted_at  # time.monotonic() of the count; None: never counted

    def heartbeat_interval(self) -> int:
        """Seconds between a node's heartbeats, for a fleet of the size counted lately."""
        clock = time.monotonic()
        if self.counted_at is None or clock - self.counted_at > FLEET_COUNT_SECONDS:
            self.nodes, self.counted_at = Node.objects.count(), clock
        return interval_for(self.nodes, current_config().node_lost_after)


def renewal_wants_report(
    *,
    lost: bool,
    last_heartbeat: datetime | None,
    stored_digest: str,
    digest: str,
    now: datetime,
    lost_after: float,
) -> bool:
    """Whether a renewal must be refused for the whole report: the control plane holds another
    report (or none: an agent that never sent a digest), or the node is lost, or was silent long
    enough to have been (its coming back starts its heard_since again, in the report's path)."""
    silent = last_heartbeat is None or now - last_heartbeat > timedelta(seconds=lost_after)
    return lost or silent or not stored_digest or digest != stored_digest


def unchanged_answer(*, node: str, interval: int, generation: int) -> dict[str, Any]:
    """A renewal's answer when nothing the node should run changed: what the web and the
    gateway (fleet.renewals) both answer."""
    return {
        "node": node,
        "heartbeat_interval": interval,
        "report": "current",
        "changed": False,
        "generation": generation,
    }


def node_renew(
    *,
    node: Node,
    generation: int | None,
    report_digest: str,
    interval: int,
    liveness: Liveness,
) -> dict[str, Any]:
    """A renewal: the node is alive, and its report is still the one whose digest it names.

    Answers `report: "send"` (nothing recorded) when the control plane wants the whole report
    instead: it holds another digest (a report it never got, or lost with a restore), the node is
    lost, or it was silent long enough to have been. Otherwise records the renewal
    (fleet.liveness) and answers `changed: false` when `generation` is the node's, or the
    replicas to run in full (as a heartbeat's answer) when it is not. `interval` is the
    heartbeat interval to answer (FleetSize.heartbeat_interval), `liveness` this process's
    renewals waiting to be written."""
    now = timezone.now()
    base: dict[str, Any] = {"node": node.name, "heartbeat_interval": interval}
    if renewal_wants_report(
        lost=node.lost,
        last_heartbeat=node.last_heartbeat,
        stored_digest=node.report_digest,
        digest=report_digest,
        now=now,
        lost_after=current_config().node_lost_after,
    ):
        return {**base, "report": "send", "changed": False, "generation": None}
    liveness.renewed(node.pk, now)
    if generation is not None and generation == node.generation:
        return unchanged_answer(
            node=node.name, interval=base["heartbeat_interval"], generation=generation
        )
    wanted = [r for r in _node_replicas(node) if _wanted(r, now)]
    return {**base, "report": "current", "changed": True, **_orders(node, wanted, now)}


def _node_replicas(node: Node) -> QuerySet[Replica]:
    """The node's replicas, oldest first, each with its model's previous revision
    (`model_previous`, for _previous_revisions): one query for what an answer holds."""
    return (
        Replica.objects.filter(node=node)
        .annotate(
            model_previous=F("model__previous"),
            model_mmproj=F("model__mmproj"),
            model_files=F("model__files"),
        )
        .order_by("created_at")
    )


def _previous_revisions(replicas: list[Replica]) -> list[dict[str, Any]]:
    """The weights a rollback of these replicas' models would start again, once a model, by the
    model's name: the node keeps them cached even when its cache is full (llmgw node
    --cache-max-gb). `replicas` come from _node_replicas."""
    previous = {r.model_name: r.model_previous for r in replicas if r.model_id is not None}  # type: ignore[attr-defined]
    mmproj = {r.model_name: r.model_mmproj for r in replicas if r.model_id is not None}  # type: ignore[attr-defined]
    files = {r.model_name: r.model_files for r in replicas if r.model_id is not None}  # type: ignore[attr-defined]
    kept = []
    for name, p in sorted(previous.items()):
        if not isinstance(p, dict) or not p.get("source"):
            continue
        kept.append({"source": p["source"], "sha256": p.get("sha256") or None})
        # The projector of that revision comes back with its weights.
        # The projector and a snapshot's other files of that revision come back with its weights.
        projector = projector_of(p["source"], mmproj.get(name) or "", p.get("origin"))
        others = [
            repository_file(p["source"], path, p.get("origin")) for path in files.get(name) or []
        ]
        for loaded in ([projector] if projector else []) + others:
            kept.append({"source": loaded.source, "sha256": loaded.sha256})
    return kept


class _Ports:
    """The ports a node's replicas may be reported on (fleet.trust, rule 2)."""

    def __init__(self, first: int, last: int, reserved: set[int]) -> None:
        self.first, self.last, self.reserved = first, last, reserved

    def problem(self, port: int | None) -> str | None:
        if port is None:
            return None
        return trust.replica_port_problem(
            port, first=self.first, last=self.last, reserved=self.reserved
        )


def _update_replica(replica: Replica, seen: dict[str, Any], now: Any, ports: _Ports) -> bool:
    state = seen["state"]
    if state not in REPORTED_STATES:
        return False
    problem = ports.problem(seen.get("port"))
    if problem is not None:
        # Failed rather than left as reported: the gateway routes to ready replicas, and a
        # failed one is withdrawn and replaced by the reconciler, as any engine that cannot
        # serve. Its port is forgotten, so that nothing ever sends a request there.
        if replica.state != Replica.FAILED or replica.message != problem:
            log.warning("replica %s of %s: %s", replica.pk, replica.model_name, problem)
        seen = {**seen, "state": Replica.FAILED, "port": None, "message": problem}
        state = Replica.FAILED
    before = (replica.state, replica.message, replica.port, replica.weights_sha256)
    if state != replica.state:
        replica.state_changed_at = now
        if state == Replica.READY:
            replica.ready_at = now
    replica.state = state
    replica.message = (seen.get("message") or "")[:4000]
    if state != before[0]:
        replica_state_changed.send(sender=Replica, replica=replica, before=before[0])
    replica.port = seen.get("port")
    replica.weights_sha256 = seen.get("sha256") or replica.weights_sha256
    numbers = seen.get("engine")
    metrics_changed = bool(numbers) and numbers != replica.engine_metrics
    if metrics_changed:
        replica.engine_metrics = numbers
        replica.engine_metrics_at = now
    changed = before != (replica.state, replica.message, replica.port, replica.weights_sha256)
    return changed or metrics_changed
