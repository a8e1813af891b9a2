"""The reconciler: one pass makes the fleet match the catalog.

Services only write desired state (counts, specs, demand). A pass reads the
catalog, the nodes and the replicas in a fixed number of queries, decides with
the pure planner in fleet.placement, and writes the difference: new replicas,
replicas withdrawn from routing (which their nodes then stop), and audit
entries for preemptions. A pass is idempotent, and a lease makes sure only one
runs at a time across all workers.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from django.db import connection, transaction
from django.db.models import DateTimeField, ExpressionWrapper, Q, Value
from django.db.models.fields.json import KT
from django.db.models.functions import Now
from django.utils import timezone

from catalog.config import current_config
from catalog.models import AuditEntry, Model
from catalog.services import audit_entry
from core.actor import SYSTEM
from core.bulkinsert import insert_many
from core.metrics import control_metrics
from llmgw.engines import DEFAULT_ENGINE

from . import autoscale, placement
from .footprint import FileFacts, Footprint, known_facts, learn_facts, model_footprints
from .models import Lease, Node, ReconcileRun, Replica, bump_generation
from .specs import current_keys, replica_revision, replica_spec, spec_key

log = logging.getLogger("llmgw.reconciler")

# A replica of the current spec that fails this many times in a row halts the
# model's replacement: retrying forever would churn nodes and hide the reason.
MAX_START_FAILURES = 3
LEASE_SECONDS = 120


@dataclass
class PassReport:
    skipped: bool = False
    busy: bool = False  # skipped because another pass held the lease
    started: list[str] = field(default_factory=list)
    withdrawn: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    unplaced: list[placement.Unplaced] = field(default_factory=list)
    nodes_lost: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)  # replicas marked to move (rule 6)


# -- the lease --------------------------------------------------------------------


def claim_lease(name: str, holder: str, seconds: int, *, now: datetime | None = None) -> bool:
    """Claim `name` for `holder` with one conditional UPDATE; False when someone else holds it.

    By the database's clock (unless a test gives `now`), as llmgw_site.leader's beat lease:
    taken and released by each worker's wall clock, a clock stepped back N seconds found the
    lease its own release had stamped N seconds ahead, and no pass ran for N seconds; one
    stepped forward could take a running pass's lease."""
    at: Any = Now() if now is None else now
    Lease.objects.get_or_create(name=name, defaults={"expires_at": at})
    until: Any = (
        ExpressionWrapper(Now() + Value(timedelta(seconds=seconds)), output_field=DateTimeField())
        if now is None
        else now + timedelta(seconds=seconds)
    )
    claimed = Lease.objects.filter(Q(expires_at__lte=at) | Q(holder=holder), name=name).update(
        holder=holder, expires_at=until
    )
    return claimed == 1


def release_lease(name: str, holder: str) -> None:
    Lease.objects.filter(name=name, holder=holder).update(holder="", expires_at=Now())


# A pass's start later than now by more than this was stamped before the clock stepped back
# (or by a machine whose clock is ahead): it tells nothing of when the next pass is due.
CLOCK_SLACK = timedelta(seconds=1)


# A periodic pass waits this many times the last pass's duration after its start: over a
# large fleet (20,000 replicas take seconds a pass) the passes that find nothing to do take at
# most about a fifth of a core.
DUTY_FACTOR = 5
# A kicked pass (a change) waits this many times the last pass's duration after that pass's
# start (kick_wait): placing a model over thousands of nodes, their reports of replicas ready
# kick a pass every half second, and passes of seconds each ran back to back, a whole core
# taken from the web and the database that were answering those nodes. Paced, they take at most
# half a core; over a small fleet (a pass of 50 ms) a kick waits at most 50 ms more.
KICK_DUTY_FACTOR = 2


def reconcile_wanted(kicked_at: datetime | None, now: datetime) -> bool:
    """Whether a pass asked for now should run. `kicked_at`: when the change that asked for it
    committed (None: the periodic pass). A kick is served by any pass that started after it; a
    periodic pass waits DUTY_FACTOR times the last pass's duration after that pass's start."""
    last = ReconcileRun.objects.filter(pk=1).first()
    if last is None or last.started_at > now + CLOCK_SLACK:
        return True
    if kicked_at is not None:
        return last.started_at < kicked_at
    return now >= last.started_at + timedelta(seconds=last.seconds * DUTY_FACTOR)


def kick_wait(kicked_at: datetime, now: datetime) -> float:
    """Seconds until a pass kicked at `kicked_at` may start (KICK_DUTY_FACTOR); 0 when it may
    start now, or when a pass that started after the kick already serves it."""
    last = ReconcileRun.objects.filter(pk=1).first()
    if last is None or last.started_at >= kicked_at or last.started_at > now + CLOCK_SLACK:
        return 0.0
    due = last.started_at + timedelta(seconds=last.seconds * KICK_DUTY_FACTOR)
    return max(0.0, (due - now).total_seconds())


def running_pass_left(now: datetime) -> float:
    """Seconds until the pass holding the lease is likely done: the last pass's duration after
    the lease was claimed; 0 when nothing tells."""
    lease = Lease.objects.filter(name="reconcile").first()
    last = ReconcileRun.objects.filter(pk=1).first()
    if lease is None or last is None or not lease.holder:
        return 0.0
    claimed = lease.expires_at - timedelta(seconds=LEASE_SECONDS)
    return max(0.0, (claimed + timedelta(seconds=last.seconds) - now).total_seconds())


def reconcile_pass(
    *,
    now: datetime | None = None,
    kicked_at: datetime | None = None,
    periodic: bool = False,
    silent: SilentNodes | None = None,
) -> PassReport:
    """One pass, counted in llmgw_reconcile_passes_total by outcome and timed in
    llmgw_reconcile_duration_seconds, unless skipped: another pass held the lease, a later pass
    already saw the change that kicked this one, or a periodic pass came too soon after the last
    (reconcile_wanted; it still looks for silent nodes then, and makes a whole pass of it when
    it finds one). `silent` is what this process logged of silent nodes before (a worker keeps
    one across its passes: fleet.apps); without it, a pass logs them afresh."""
    board = control_metrics()
    silent = silent if silent is not None else SilentNodes()
    at = now or timezone.now()
    if kicked_at is not None and not reconcile_wanted(kicked_at, at):
        board.reconcile_passes.labels("skipped").inc()
        return PassReport(skipped=True)
    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    if not claim_lease("reconcile", holder, LEASE_SECONDS, now=now):
        board.reconcile_passes.labels("skipped").inc()
        return PassReport(skipped=True, busy=True)
    started = time.monotonic()
    started_at = timezone.now()
    outcome = "failed"
    try:
        declared: list[str] = []
        if periodic and not reconcile_wanted(None, at):
            with transaction.atomic():
                lost = _Pass(at, silent)
                _mark_lost_nodes(lost)
            if not lost.report.nodes_lost:
                outcome = "skipped"
                return PassReport(skipped=True)
            declared = lost.report.nodes_lost
        # Before the transaction: a header read waits on HTTP, and a row lock should not.
        learn_facts(Model.objects.all(), now=now)
        with transaction.atomic():
            report = _reconcile(now or timezone.now(), silent)
        report.nodes_lost = declared + report.nodes_lost
        outcome = "done"
        ReconcileRun.objects.update_or_create(
            pk=1, defaults={"started_at": started_at, "seconds": time.monotonic() - started}
        )
        return report
    finally:
        release_lease("reconcile", holder)
        board.reconcile_passes.labels(outcome).inc()
        if outcome != "skipped":
            board.reconcile_seconds.observe(time.monotonic() - started)


# -- what each model wants --------------------------------------------------------


def _resources(replica: Replica | Active) -> placement.Resources:
    return placement.Resources(
        replica.memory_gb, replica.cores, replica.gpus, replica.gpu_memory_gb
    )


def planner_profile(profile: dict[str, Any], memory: Footprint) -> placement.Profile:
    """A profile as the planner reserves it: host memory and GPU memory from its footprint
    (fleet.footprint), the GPU memory over all its GPUs (the planner splits it evenly)."""
    resources = placement.Resources(
        memory.memory_gb,
        profile.get("cores", 0),
        profile.get("gpus", 0),
        memory.gpu_memory_gb,
    )
    return placement.Profile(profile["name"], resources, memory.note())


def model_demand(model: Model, desired: int, facts: FileFacts | str) -> placement.ModelDemand:
    """What the planner sees of a model; ``facts`` are its file's (fleet.footprint)."""
    return placement.ModelDemand(
        name=model.name,
        klass=model.class_in_force,
        minimum=min(model.min_replicas, desired),
        desired=desired,
        profiles=tuple(
            planner_profile(p, memory)
            for p, memory in zip(model.profiles, model_footprints(model, facts), strict=True)
        ),
        engine=model.engine_name,
    )


MIB_PER_GB = 1024


def node_engines(node: Node | Member) -> list[str]:
    """The engines a node's agent has: what it reported, the default engine for an agent that does not
    say (one from before there were several)."""
    return list(node.engines or [DEFAULT_ENGINE])


def node_gpu_engines(node: Node | Member) -> list[str]:
    """The engines of a node that can put a model on GPUs: what its agent reported, or, from
    an agent that does not say, the default engine when its binary has a GPU backend."""
    if node.gpu_engines:
        return list(node.gpu_engines)
    gpu = any(str(backend).upper() != "CPU" for backend in node.engine_backends or [])
    return [DEFAULT_ENGINE] if gpu else []


def has_gpu_engine(node: Node | Member) -> bool:
    """Whether any engine of the node can put a model on its GPUs."""
    return bool(node_gpu_engines(node))


def node_devices(node: Node | Member) -> tuple[placement.Device, ...]:
    """The node's GPUs for the planner: as its agent reported them (devices whose figures are
    not numbers are left out: a report is hostile until checked), or, from an agent that
    reports none but declares GPUs (an older agent), one device per declared GPU of the
    declared memory each, with nothing observed in use. A use above the total is taken as
    the total."""
    devices: dict[int, placement.Device] = {}
    for device in node.devices or []:
        if not isinstance(device, dict):
            continue
        index, total, used = (device.get(k) for k in ("index", "memory_total_mb", "memory_used_mb"))
        if not all(_count(v) for v in (index, total, used)):
            continue  # a figure that is not a count: the device is not believed
        assert isinstance(index, int) and isinstance(total, int) and isinstance(used, int)
        devices.setdefault(
            index, placement.Device(index, total / MIB_PER_GB, min(used, total) / MIB_PER_GB)
        )
    if devices:
        return tuple(devices[i] for i in sorted(devices))
    return tuple(placement.Device(i, float(node.gpu_memory_gb)) for i in range(node.gpus))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def planner_node(node: Node | Member) -> placement.Node:
    return placement.Node(
        name=node.name,
        capacity=placement.Resources(node.memory_gb, node.cores, node.gpus, node.gpu_memory_gb),
        schedulable=node.schedulable,
        devices=node_devices(node),
        gpu_engine=has_gpu_engine(node),
        engines=frozenset(node_engines(node)),
        gpu_engines=frozenset(node_gpu_engines(node)),
    )


def planner_replica(
    replica: Replica | Active, node_names: dict[int, str], leaving: bool = False
) -> placement.Replica:
    """``leaving``: it serves only until its replacement is ready (placement.Replica)."""
    # A replica whose model was removed keeps its name; keyed apart so that a new
    # model of the same name does not adopt it.
    owner = replica.model_name if replica.model_id is not None else f"removed:{replica.pk}"
    return placement.Replica(
        id=str(replica.pk),
        model=owner,
        node=node_names[replica.node_id],
        profile=replica.profile,
        resources=_resources(replica),
        devices=tuple(i for i in replica.devices or [] if isinstance(i, int)),
        leaving=leaving,
    )


# -- one pass ---------------------------------------------------------------------


@dataclass(slots=True)
class Active:
    """A replica in routing as a pass reads it: the columns it decides by, a row, not a model
    instance (over 20,000 replicas, building instances, their specs parsed, was most of a
    steady pass's time). `source`, `sha256` and the mmproj ones are its spec's, which say its
    files' revision."""

    pk: uuid.UUID
    model_id: int | None
    model_name: str
    node_id: int
    profile: str
    memory_gb: float
    cores: float
    gpus: int
    gpu_memory_gb: float
    devices: list[Any]
    state: str
    message: str
    spec_key: str
    move_reason: str
    created_at: datetime
    source: str | None
    sha256: str | None
    mmproj_source: str | None = None
    mmproj_sha256: str | None = None
    files: Any = None  # a snapshot's other files (the spec's JSON, as text on some databases)

    @property
    def revision(self) -> str:
        mmproj = {"source": self.mmproj_source, "sha256": self.mmproj_sha256}
        files = json.loads(self.files) if isinstance(self.files, str) else self.files
        return replica_revision(
            {"source": self.source, "sha256": self.sha256, "mmproj": mmproj, "files": files}
        )


_SPEC_COLUMNS = ("source", "sha256", "mmproj_source", "mmproj_sha256", "files")


@dataclass(slots=True)
class Member:
    """A node as a pass reads it: what placement decides by, a row, not a model instance (5,000
    of those, their JSON and times loaded, for a pass that reads none of the rest)."""

    pk: int
    name: str
    memory_gb: float
    cores: float
    gpus: int
    gpu_memory_gb: float
    cordoned: bool
    lost: bool
    last_heartbeat: datetime | None
    devices: list[Any]
    engine_backends: list[Any]
    engines: list[Any]
    gpu_engines: list[Any]

    @property
    def schedulable(self) -> bool:
        return not self.cordoned and not self.lost and self.last_heartbeat is not None


def fleet_members() -> list[Member]:
    """Every node, as rows."""
    return [Member(*row) for row in Node.objects.values_list(*Member.__dataclass_fields__)]


def active_replicas() -> list[Active]:
    """Every replica in routing (not withdrawn), as rows."""
    columns = [f for f in Active.__dataclass_fields__ if f not in _SPEC_COLUMNS]
    rows = Replica.objects.filter(withdrawn_at__isnull=True).values_list(
        *columns,
        KT("spec__source"),
        KT("spec__sha256"),
        KT("spec__mmproj__source"),
        KT("spec__mmproj__sha256"),
        KT("spec__files"),
    )
    return [Active(*row) for row in rows]


class _Pass:
    def __init__(self, now: datetime, silent: SilentNodes) -> None:
        self.now = now
        self.silent = silent
        self.config = current_config()
        self.report = PassReport()
        self.withdraw: dict[str, str] = {}  # replica id -> reason
        self.audit: list[AuditEntry] = []
        self.dirty_models: dict[int, Model] = {}
        self.surging: set[int] = set()  # models asking for one extra replica to replace an old one
        self.replacing: set[int] = set()  # models with replicas out of date or moving
        self.leaving: set[str] = set()  # replicas serving until their replacement is ready
        self.moving: set[int] = set()  # surging models whose only replacements are moves
        self.cancel_moves: list[Active] = []  # moves whose replacement fits nowhere now
        self.node_names: dict[int, str] = {}

    def withdraw_replica(self, replica: Active, reason: str) -> None:
        self.withdraw.setdefault(str(replica.pk), reason)


# What the last pass of this process saw when it changed nothing (`Quiet`); None when there is
# nothing to compare with.
_quiet: Quiet | None = None


class Stamp(NamedTuple):
    """The fleet as a pass reads it, hashed by PostgreSQL (`fleet_stamp`): per table a count and
    a sum of the rows' hashes, so that a row changed, added or gone changes it."""

    nodes: tuple[int, int]
    placed: tuple[int, int]  # the replicas in routing, by what placement decides by
    states: int  # their states and messages
    failed: int  # how many of them are failed


@dataclass(frozen=True)
class Quiet:
    """A pass that changed nothing, by what it read: the fleet's stamp, and per model its row,
    the replicas it wants now and its file's facts (`models`). The next pass that reads the same
    would plan the same nothing: it stops there (a few queries over 20,000 replicas, instead of
    reading them all and planning).

    A replica's state decides nothing unless it failed (it is withdrawn) or its model is being
    replaced or counts failures (`states_matter`: a new replica ready lets an old one go); so
    without those, replicas turning ready change nothing a pass would do either. Why: a model of
    thousands placed, their nodes' reports of them ready kick a pass every second or so, and
    each of those passes read and planned the whole fleet again (about a second of the worker's
    CPU at 20,000 replicas) while the web, the gateway and the database were busiest."""

    stamp: Stamp
    models: str
    unplaced: tuple[placement.Unplaced, ...]
    states_matter: bool

    def holds(self, stamp: Stamp, models: str) -> bool:
        """Whether a pass that reads `stamp` and `models` would plan what this one did."""
        if models != self.models:
            return False
        if stamp == self.stamp:
            return True
        return (
            not self.states_matter
            and stamp.failed == 0
            and (stamp.nodes, stamp.placed) == (self.stamp.nodes, self.stamp.placed)
        )


# The columns a pass decides by, hashed by PostgreSQL into a sum per table: nodes (not their
# heartbeats' times, only whether they ever beat: placement's `schedulable`) and the replicas in
# routing, where and what they are apart from their states. A change of any of them, a row added
# or gone, changes the sum.
_NODE_STAMP = """
    SELECT count(*), coalesce(sum(hashtextextended(concat_ws('|', id, name, memory_gb, cores,
        gpus, gpu_memory_gb, cordoned, lost, last_heartbeat IS NULL, devices::text,
        engine_backends::text, engines::text, gpu_engines::text), 0)), 0)
    FROM fleet_node"""
_REPLICA_STAMP = """
    SELECT count(*), coalesce(sum(hashtextextended(concat_ws('|', id, model_id, model_name,
        node_id, profile, memory_gb, cores, gpus, gpu_memory_gb, devices::text, spec_key,
        move_reason, spec->>'source', spec->>'sha256'), 0)), 0),
        coalesce(sum(hashtextextended(concat_ws('|', id, state, message), 0)), 0),
        count(*) FILTER (WHERE state = %s)
    FROM fleet_replica WHERE withdrawn_at IS NULL"""


def fleet_stamp() -> Stamp | None:
    """The nodes' and the replicas' stamp (PostgreSQL); None elsewhere (every pass is whole)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(_NODE_STAMP)
        nodes = cursor.fetchone()
        cursor.execute(_REPLICA_STAMP, [Replica.FAILED])
        count, placed, states, failed = cursor.fetchone()
    return Stamp((nodes[0], nodes[1]), (count, placed), states, failed)


def _models_said(run: _Pass, models: dict[int, Model], facts: dict[str, Any]) -> str:
    """Everything about the models a pass decides by: their rows (but the time of their last
    request, which only moves what they want now, said beside it), their class and canary in
    force, what their file's facts make each profile reserve, and the cluster's settings.

    What a profile reserves, not the facts themselves: a pass reads a few models' headers at a
    time (fleet.footprint.READS_PER_PASS), and a header that could not be read leaves the
    profile's own figures in force, as one not read yet did. Said as facts, 20 models added at
    once whose headers could not be read made five passes in a row plan the whole fleet again
    (5-7 s each while their 20,000 replicas were being placed) for nothing."""
    # (An autoscale state's figures change at every pass; the replicas it wants are in `desired`.)
    volatile = {
        "demand_at",
        "updated_at",
        "update_checked_at",
        "update_check_error",
        "autoscale_state",
    }
    said = [repr(run.config)]
    for model in sorted(models.values(), key=lambda m: m.pk):
        row = {
            k: v for k, v in model.__dict__.items() if not k.startswith("_") and k not in volatile
        }
        desired = model.desired_replicas(run.now, run.config.default_idle_timeout)
        reserved = [
            planner_profile(profile, memory).resources
            for profile, memory in zip(
                model.profiles, model_footprints(model, facts[model.name]), strict=True
            )
        ]
        said.append(repr((row, desired, model.class_in_force, model.canary_in_force, reserved)))
    return "\n".join(said)


def forget_quiet() -> None:
    """The next pass reads and plans everything (a test that changed what no stamp covers)."""
    global _quiet
    _quiet = None


def _reconcile(now: datetime, silent: SilentNodes) -> PassReport:
    global _quiet
    run = _Pass(now, silent)
    _mark_lost_nodes(run)
    models = {m.pk: m for m in Model.objects.all()}
    autoscale.evaluate(now, models.values(), run.config.default_idle_timeout)
    facts = known_facts(models.values())
    stamp = fleet_stamp()
    said = _models_said(run, models, facts) if stamp is not None else ""
    last = _quiet
    if last is not None and stamp is not None and last.holds(stamp, said):
        run.report.unplaced = list(last.unplaced)
        return run.report
    _quiet = None
    nodes = fleet_members()
    node_names = run.node_names = {n.pk: n.name for n in nodes}
    active = active_replicas()
    by_model: dict[int, list[Active]] = {}
    for replica in active:
        if replica.model_id is not None:
            by_model.setdefault(replica.model_id, []).append(replica)

    demands = []
    for model in models.values():
        mine = by_model.get(model.pk, [])
        desired = model.desired_replicas(now, run.config.default_idle_timeout)
        planner_desired, mine = _replacement(run, model, mine, desired)
        demand = model_demand(model, planner_desired, facts[model.name])
        if model.pk in run.moving:
            demand = replace(demand, moving=True)
        demands.append(demand)
        by_model[model.pk] = mine

    still_active = [r for r in active if str(r.pk) not in run.withdraw]
    plan = placement.plan_placement(
        [planner_node(n) for n in nodes],
        demands,
        [planner_replica(r, node_names, str(r.pk) in run.leaving) for r in still_active],
    )
    _fall_back_in_place(run, models, by_model, plan)
    _apply(run, plan, models, nodes, {str(r.pk): r for r in active})
    report = run.report
    if stamp is not None and not (
        report.started
        or report.withdrawn
        or run.dirty_models
        or run.audit
        or report.nodes_lost
        or run.cancel_moves
    ):
        states_matter = bool(run.replacing) or any(m.rollout_failures for m in models.values())
        _quiet = Quiet(stamp, said, tuple(plan.unplaced), states_matter)
    return report


class SilentNodes:
    """The silent nodes a process last logged as not declared lost, so that the line is written
    once, not at every pass: a worker makes one (fleet.apps) and hands it to each pass."""

    def __init__(self) -> None:
        self.logged = ""  # their names, as the line gave them; "": none logged

    def heard_again(self) -> None:
        """Someone is heard again: the next silence is logged, even of the same nodes."""
        self.logged = ""

    def not_declared(self, names: str, lost_after: float) -> None:
        if names == self.logged:
            return
        self.logged = names
        log.warning(
            "no heartbeat from %s for %ss, but not declared lost: no other node has been "
            "heard that long (the control plane itself may have been unreachable)",
            names,
            lost_after,
        )


def _mark_lost_nodes(run: _Pass) -> None:
    """Nodes silent for node_lost_after are lost, but only while the control plane hears others.

    Why: silence is the node's fault only if heartbeats were getting through. When the control
    plane heard nobody (its web process, its database or the network in front of it was down
    for longer than node_lost_after), every node was silent, and declaring them all lost when it
    comes back would withdraw every replica from routing at once: healthy engines answering 503
    until their nodes heartbeat again and get new ones. So a node is lost only when another has
    been heard without a gap for at least node_lost_after. The cost: the death of every node at
    once (or of the only one) is not declared; their replicas stay routed, and requests to them
    fail with a status (the engine is gone) until the nodes come back, as they would with
    nowhere else to run them anyway."""
    lost_after = timedelta(seconds=run.config.node_lost_after)
    cutoff = run.now - lost_after
    silent = list(
        Node.objects.filter(lost=False, last_heartbeat__lt=cutoff).values_list("pk", "name")
    )
    if not silent:
        return
    hearing = Node.objects.filter(
        lost=False,
        heard_since__lte=cutoff,
        last_heartbeat__gte=cutoff,
    )
    if not hearing.exists():
        names = ", ".join(sorted(name for _, name in silent))
        run.silent.not_declared(names, run.config.node_lost_after)
        return
    run.silent.heard_again()
    ids = [pk for pk, _ in silent]
    Node.objects.filter(pk__in=ids).update(lost=True)
    seconds = run.config.node_lost_after
    Replica.objects.filter(node_id__in=ids, withdrawn_at__isnull=True).update(
        withdrawn_at=run.now,
        withdraw_reason=f"its node sent no heartbeat for {seconds}s and is lost",
    )
    bump_generation(ids)
    run.report.nodes_lost = [name for _, name in silent]
    log.warning("nodes lost (no heartbeat for %ss): %s", seconds, ", ".join(run.report.nodes_lost))


def _replacement(
    run: _Pass, model: Model, mine: list[Active], desired: int
) -> tuple[int, list[Active]]:
    """Failures and out-of-date replicas of one model; returns the count to plan for and what stays."""
    keys = current_keys(model)
    first_key = keys[model.profiles[0]["name"]] if model.profiles else ""
    if model.rollout_spec_key and model.rollout_spec_key != first_key:
        # The spec changed since the last failures (a rollback, a fix): start afresh.
        _set(run, model, rollout_failures=0, rollout_halted="", rollout_spec_key="")

    kept = []
    for replica in mine:
        if replica.state == Replica.FAILED:
            run.withdraw_replica(replica, f"failed: {replica.message}")
            if replica.spec_key == keys.get(replica.profile):
                failures = model.rollout_failures + 1
                _set(run, model, rollout_failures=failures, rollout_spec_key=first_key)
                if failures >= MAX_START_FAILURES and not model.rollout_halted:
                    reason = (
                        f"halted: a new replica failed to become ready {failures} times in a row; "
                        f"the last on node {run.node_names[replica.node_id]}: {replica.message}"
                    )
                    _set(run, model, rollout_halted=reason)
                    run.audit.append(audit_entry(SYSTEM, model.name, "rollout-halted", reason))
        else:
            kept.append(replica)
    mine = kept
    # Out of date, or moving to spread the model (rule 6): replaced alike, one at a time.
    stale = [r for r in mine if r.spec_key != keys.get(r.profile) or r.move_reason]
    fresh = [r for r in mine if r.spec_key == keys.get(r.profile) and not r.move_reason]
    if stale:
        run.replacing.add(model.pk)
        run.leaving.update(str(r.pk) for r in stale)
    if model.rollout_failures and any(r.state == Replica.READY for r in fresh):
        _set(run, model, rollout_failures=0, rollout_halted="", rollout_spec_key="")

    if model.rollout_halted:
        # Keep what runs (the old replicas serve on); start nothing of the failing spec.
        return min(desired, len(mine)), mine
    if not stale:
        return desired, mine
    canary = model.canary_in_force
    if fresh and canary is not None and all(r.revision == canary.revision for r in fresh):
        # A canary update: one replica of the new revision serves beside the old ones, which
        # stay, until it is promoted (the replacement goes on from here) or rolled back (then
        # it is the out-of-date one, and leaves).
        return len(mine), mine
    if any(r.state != Replica.READY for r in fresh):
        return len(mine), mine  # a replacement is on its way: wait for it
    if len(mine) > desired:
        # The new replica is ready: now the old one leaves.
        victim = _stale_victim(stale)
        run.withdraw_replica(victim, "replaced by an up-to-date replica")
        return desired, [r for r in mine if r is not victim]
    if desired == 0:
        return 0, mine
    # Start one extra replica of the current spec before stopping an old one.
    run.surging.add(model.pk)
    if all(r.move_reason for r in stale):
        run.moving.add(model.pk)
    return len(mine) + 1, mine


def _stale_victim(stale: list[Active]) -> Active:
    """Not-ready ones first (they serve nobody), then the oldest."""
    return sorted(stale, key=lambda r: (r.state == Replica.READY, r.created_at))[0]


def _fall_back_in_place(
    run: _Pass, models: dict[int, Model], by_model: dict[int, list[Active]], plan: placement.Plan
) -> None:
    """No room for an extra replica: replace in place, one at a time, keeping min - 1 serving."""
    unplaced = {u.model for u in plan.unplaced}
    for model in models.values():
        if model.pk not in run.surging or model.name not in unplaced:
            continue
        mine = by_model.get(model.pk, [])
        keys = current_keys(model)
        stale = [r for r in mine if r.spec_key != keys.get(r.profile)]
        if not stale:
            # Only moves, whose replacement fits nowhere now: they stay where they are.
            run.cancel_moves.extend(r for r in mine if r.move_reason)
            continue
        victim = _stale_victim(stale)
        ready_after = sum(1 for r in mine if r.state == Replica.READY and r is not victim)
        if ready_after >= max(model.min_replicas - 1, 0):
            run.withdraw_replica(victim, "replaced in place: no room for an extra replica")


def _set(run: _Pass, model: Model, **values: Any) -> None:
    for name, value in values.items():
        setattr(model, name, value)
    run.dirty_models[model.pk] = model


def _apply(
    run: _Pass,
    plan: placement.Plan,
    models: dict[int, Model],
    nodes: list[Member],
    active: dict[str, Active],
) -> None:
    """Write the plan: its stops and preemptions withdrawn, its starts inserted, the nodes'
    generations moved, the audit and the models' rollout fields written."""
    for stop in plan.stops:
        run.withdraw_replica(active[stop.replica_id], stop.reason)
    for stop in plan.preemptions:
        run.withdraw_replica(active[stop.replica_id], stop.reason)
        run.audit.append(
            audit_entry(
                SYSTEM, stop.model, "preempt", f"replica on {stop.node} stopped: {stop.reason}"
            )
        )
        run.report.preempted.append(stop.replica_id)

    # The nodes whose answer changes learn it at their next renewal (services.node_renew), by
    # their generation, moved in this transaction. Nodes losing a replica are locked first, as a
    # heartbeat locks its node's row before its replicas': taken in the other order, a heartbeat
    # and this pass could deadlock on a replica withdrawn here. Nodes only given new replicas
    # (rows no one else sees before the commit) are locked last, just before the commit: locked
    # first, thousands of them (a model of thousands placed) would stay locked for the whole
    # insert, their heartbeats waiting on the web's threads and their renewals not written
    # (fleet.liveness skips locked rows), until they were declared lost.
    _write_moves(run, plan, models, active)
    node_ids = {n.name: n.pk for n in nodes}
    losing = {active[i].node_id for i in run.withdraw}
    bump_generation(losing)
    _write_withdrawals(run, active)
    new = _new_replicas(run, plan, models, node_ids)
    if new:
        insert_many(Replica, new)  # COPY on PostgreSQL: core.bulkinsert says why
        run.report.started = [str(r.pk) for r in new]
    bump_generation({node_ids[s.node] for s in plan.starts} - losing)
    if run.audit:
        AuditEntry.objects.bulk_create(run.audit, batch_size=500)
    if run.dirty_models:
        Model.objects.bulk_update(
            list(run.dirty_models.values()),
            ["rollout_failures", "rollout_halted", "rollout_spec_key"],
            batch_size=500,
        )
    run.report.unplaced = list(plan.unplaced)
    if new or run.withdraw:
        log.info(
            "reconcile: started %d, withdrew %d, unplaced %d",
            len(new),
            len(run.withdraw),
            len(plan.unplaced),
        )


def _write_moves(
    run: _Pass, plan: placement.Plan, models: dict[int, Model], active: dict[str, Active]
) -> None:
    """Mark the replicas the plan moves (its replacement is started by the next pass, as for an
    out-of-date one), audited with the reason; and clear the moves that cannot be made now."""
    by_name = {m.name: m for m in models.values()}
    marked = []
    for move in plan.moves:
        model = by_name[move.model]
        if (
            model.pk in run.replacing
            or model.canary_in_force is not None
            or model.rollout_halted
            or move.replica_id in run.withdraw
        ):
            continue  # a replacement, a canary or a halt decides where its replicas go now
        reason = (
            f"moving to spread the model: node {move.node} holds {move.here} of its replicas "
            f"and node {move.to}, which has room for one, holds none"
        )
        marked.append(Replica(pk=active[move.replica_id].pk, move_reason=reason))
        run.audit.append(
            audit_entry(SYSTEM, model.name, "move", f"replica on {move.node}: {reason}")
        )
    for replica in run.cancel_moves:
        if str(replica.pk) not in run.withdraw:
            marked.append(Replica(pk=replica.pk, move_reason=""))
    if marked:
        Replica.objects.bulk_update(marked, ["move_reason"], batch_size=500)
    run.report.moved = [str(r.pk) for r in marked if r.move_reason]


def _write_withdrawals(run: _Pass, active: dict[str, Active]) -> None:
    """Mark the replicas the pass withdraws, with their reasons, in one bulk update."""
    if not run.withdraw:
        return
    withdrawn = [
        Replica(pk=active[replica_id].pk, withdrawn_at=run.now, withdraw_reason=reason)
        for replica_id, reason in run.withdraw.items()
    ]
    Replica.objects.bulk_update(withdrawn, ["withdrawn_at", "withdraw_reason"], batch_size=500)
    run.report.withdrawn = list(run.withdraw)


def _new_replicas(
    run: _Pass, plan: placement.Plan, models: dict[int, Model], node_ids: dict[str, int]
) -> list[Replica]:
    """The rows of the plan's starts, not yet inserted."""
    by_name = {m.name: m for m in models.values()}
    new = []
    # One spec (and its key) per model and profile, however many replicas share it: a model of
    # 1,000 replicas placed at once would otherwise build the same spec 1,000 times.
    specs: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
    for start in plan.starts:
        model = by_name[start.model]
        made = specs.get((start.model, start.profile))
        if made is None:
            profile = next(p for p in model.profiles if p["name"] == start.profile)
            spec = replica_spec(model, profile)
            made = specs[(start.model, start.profile)] = (spec, spec_key(spec))
        spec, key = made
        new.append(
            Replica(
                model=model,
                model_name=model.name,
                node_id=node_ids[start.node],
                profile=start.profile,
                memory_gb=start.resources.memory_gb,
                cores=start.resources.cores,
                gpus=start.resources.gpus,
                gpu_memory_gb=start.resources.gpu_memory_gb,
                devices=list(start.devices),
                slots=spec["slots"],
                spec=spec,
                spec_key=key,
                created_at=run.now,
                state_changed_at=run.now,
            )
        )
    return new
