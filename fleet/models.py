"""Nodes, the replicas placed on them, and the lease that keeps reconcile passes one at a time."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from django.db import models
from django.utils import timezone

from llmgw import bearer
from llmgw.node.config import DEFAULT_PORT_RANGE

from .trust import Capacity, believed


def hash_token(token: str) -> str:
    """What Node.token_hash keeps of a node's token: every bearer secret's digest (llmgw.bearer)."""
    return bearer.digest(token)


def bump_generation(node_ids: Iterable[int]) -> None:
    """Tell these nodes that what they should run changed (Node.generation): called in the
    transaction that changed it, so that no renewal sees the new generation without the change."""
    ids = sorted(set(node_ids))
    for start in range(0, len(ids), 1000):
        Node.objects.filter(pk__in=ids[start : start + 1000]).update(
            generation=models.F("generation") + 1
        )


class Node(models.Model):
    """A machine that runs replicas; its agent heartbeats capacity and replica states."""

    name = models.CharField(max_length=100, unique=True)
    # Only the hash is kept: the token is shown once, when the node is added.
    token_hash = models.CharField(max_length=64, unique=True)
    address = models.CharField(
        max_length=255,
        default="127.0.0.1",
        help_text="where its engines listen: the address it connects from, or one staff allowed",
    )
    address_allow = models.JSONField(
        default=list,
        blank=True,
        help_text=(
            "networks (CIDR) the node may report as its engines' address besides the one it "
            "connects from, for a node behind NAT or with several interfaces; set by staff, "
            "checked on its next heartbeat"
        ),
    )
    port_first = models.PositiveIntegerField(
        default=DEFAULT_PORT_RANGE[0], help_text="the first port its engines may listen on"
    )
    port_last = models.PositiveIntegerField(
        default=DEFAULT_PORT_RANGE[1], help_text="the last port its engines may listen on"
    )
    # What placement counts on: the capacity believed of the node (fleet.trust.believed).
    memory_gb = models.FloatField(default=0)
    cores = models.FloatField(default=0)
    gpus = models.PositiveIntegerField(default=0)
    gpu_memory_gb = models.FloatField(default=0)
    registered_capacity = models.JSONField(
        null=True,
        blank=True,
        help_text=(
            "the capacity it first reported (or staff last accepted): reports above it are "
            "believed only up to it"
        ),
    )
    reported_capacity = models.JSONField(
        default=dict, blank=True, help_text="the capacity its agent last reported"
    )
    cordoned = models.BooleanField(default=False)
    lost = models.BooleanField(default=False)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    # The first heartbeat of the node's current run of heartbeats without a long gap: the
    # reconciler declares a silent node lost only while another has been heard that long.
    heard_since = models.DateTimeField(null=True, blank=True)
    agent = models.JSONField(default=dict, blank=True)
    # Its GPUs as its agent last found them (NVML, nvidia-smi, or --gpus/--gpu-memory): a list
    # of {index, uuid, name, memory_total_mb, memory_used_mb, utilization_pct}, the memory used
    # being every process's (llmgw's engines included).
    devices = models.JSONField(default=list, blank=True)
    # Where the devices came from: "nvml", "nvidia-smi", "flags" or "" (none found).
    devices_source = models.CharField(max_length=20, blank=True, default="")
    # The backends its engine binary was built with (its --list-devices), like
    # ["CPU", "CUDA"]: a replica with GPUs goes only to a node whose engine has a GPU backend.
    engine_backends = models.JSONField(default=list, blank=True)
    # The engines its agent has installed (llmgw.engines' names): a replica goes only to a node
    # that has its model's engine. Empty from an agent that does not say: the default engine only.
    engines = models.JSONField(default=list, blank=True)
    # Those of them that can put a model on GPUs (a GPU backend): a GPU replica goes only to a
    # node where its model's engine can. Empty from an agent that does not say: engine_backends
    # decides for the default engine.
    gpu_engines = models.JSONField(default=list, blank=True)
    # What the node should run, versioned: bumped (in the transaction that changes it) whenever
    # a replica is placed on it or withdrawn from it, or its warnings change. A renewal that
    # names the current generation is answered "nothing changed" without reading its replicas.
    generation = models.PositiveBigIntegerField(default=0)
    # The digest its agent gave of its last full report (llmgw.node.report): a renewal with the
    # same digest says nothing changed on the node since.
    report_digest = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def heard_since_with(self, now: datetime, *, lost_after: float) -> datetime:
        """`heard_since` once a heartbeat arrives at `now`: unchanged while they keep coming, `now`
        after a gap longer than `lost_after` (a silence that could have had it declared lost) or
        when lost. A shorter gap (a slow heartbeat on a busy machine) does not start it again."""
        previous = self.last_heartbeat
        gap = timedelta(seconds=lost_after)
        if self.heard_since is None or self.lost or previous is None or now - previous > gap:
            return now
        return self.heard_since

    @property
    def state(self) -> str:
        if self.last_heartbeat is None:
            return "waiting for its agent"
        if self.lost:
            return "lost"
        return "cordoned" if self.cordoned else "ready"

    @property
    def schedulable(self) -> bool:
        return not self.cordoned and not self.lost and self.last_heartbeat is not None

    def capacity_notes(self) -> list[str]:
        """A sentence for each figure the node reports and is not believed (fleet.trust)."""
        if not self.reported_capacity or self.registered_capacity is None:
            return []
        reported = Capacity.from_json(self.reported_capacity)
        _, notes = believed(reported, Capacity.from_json(self.registered_capacity))
        return [
            f"Node {self.name} {note}: `llmgw ctl node accept-capacity {self.name}` believes "
            "what it reports."
            for note in notes
        ]


# How long a removed node's token is remembered (RemovedNode): its agent hears within seconds,
# unless it was stopped, or its machine off, when the node was removed; a month covers a
# machine brought back from a shelf, and bounds the table by the removals of a month.
REMOVED_NODE_KEPT = timedelta(days=30)


class RemovedNode(models.Model):
    """A node removed lately, by its token's digest, and by whom: its agent, still heartbeating
    with that token, is told its node was removed (410), not that its token is unknown (401),
    and stops its engines. Rows older than REMOVED_NODE_KEPT are deleted at the next removal.
    A node added again under the same name has a new token: this row is not its."""

    token_hash = models.CharField(max_length=64, unique=True)
    name = models.CharField(max_length=100)
    removed_by = models.CharField(max_length=150)
    door = models.CharField(max_length=20, blank=True, default="")
    removed_at = models.DateTimeField(default=timezone.now, db_index=True)

    def __str__(self) -> str:
        return f"{self.name}, removed by {self.removed_by} at {self.removed_at:%Y-%m-%d %H:%M}"

    @property
    def message(self) -> str:
        """What its agent is answered, and logs."""
        return (
            f"This node ({self.name}) was removed by {self.removed_by} at "
            f"{self.removed_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC; the control plane no "
            f"longer takes its token. To run replicas on this machine again, add the node again "
            f"(`llmgw ctl node add {self.name}`) and start its agent with the new token."
        )


class Replica(models.Model):
    """One engine process of a model on a node, and what it was started with.

    A replica is withdrawn from routing (withdrawn_at set) before its node is told
    to stop it; rows of stopped replicas are deleted once the node no longer
    reports them.
    """

    PENDING = "pending"
    FETCHING = "fetching"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STATES = [(s, s) for s in (PENDING, FETCHING, STARTING, READY, FAILED)]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    model = models.ForeignKey(
        "catalog.Model", null=True, blank=True, on_delete=models.SET_NULL, related_name="replicas"
    )
    model_name = models.CharField(max_length=100, db_index=True)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="replicas")
    profile = models.CharField(max_length=50)
    memory_gb = models.FloatField(default=0)
    cores = models.FloatField(default=0)
    gpus = models.PositiveIntegerField(default=0)
    gpu_memory_gb = models.FloatField(default=0)
    # The indices (Node.devices) of the GPUs it was placed on, one per GPU it reserves.
    devices = models.JSONField(default=list, blank=True)
    # What the replica was started with; a model whose current spec differs has
    # this replica out of date (see fleet.specs).
    spec = models.JSONField(default=dict)
    spec_key = models.CharField(max_length=64)
    state = models.CharField(max_length=20, choices=STATES, default=PENDING)
    message = models.TextField(blank=True, default="")
    port = models.PositiveIntegerField(null=True, blank=True)
    weights_sha256 = models.CharField(max_length=64, blank=True, default="")
    # Requests the engine serves at once (its profile's slots): the gateway counts free ones.
    slots = models.PositiveIntegerField(default=1)
    # The engine's own numbers from its last heartbeat (llmgw.engine.METRIC_NAMES, plus
    # tokens_per_second over the agent's last reading), and when they were reported.
    engine_metrics = models.JSONField(default=dict, blank=True)
    engine_metrics_at = models.DateTimeField(null=True, blank=True)
    withdrawn_at = models.DateTimeField(null=True, blank=True, db_index=True)
    withdraw_reason = models.TextField(blank=True, default="")
    # Set when the reconciler moves it to spread its model over nodes (rule 6 of
    # docs/nodes.md#how-placement-decides): it serves until a replacement elsewhere is ready.
    move_reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    ready_at = models.DateTimeField(null=True, blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["model_name", "created_at"]

    def __str__(self) -> str:
        return f"{self.model_name}@{self.node_id} ({self.state})"

    @property
    def routable(self) -> bool:
        return self.state == self.READY and self.withdrawn_at is None

    @property
    def endpoint(self) -> str | None:
        if self.port is None:
            return None
        return f"http://{self.node.address}:{self.port}"


class LoadSignal(models.Model):
    """One gateway process's fair-queue figures over its last few seconds, per model: what
    fleet.autoscale sums over the fresh rows of every process and machine. One row a process
    (a new one at each start); rows not written for SIGNAL_KEEP are deleted by the autoscaler."""

    writer = models.CharField(max_length=64, unique=True)
    at = models.DateTimeField(db_index=True)
    # {model: {"waits": [requests per fleet.autoscale.WAIT_BOUNDS bucket], "waiting": n,
    #  "in_service": n}}; a model with nothing asked of it is left out.
    figures = models.JSONField(default=dict)

    def __str__(self) -> str:
        return f"load of {self.writer} at {self.at:%H:%M:%S}"


class Lease(models.Model):
    """A named lease claimed with a conditional UPDATE, so that only one holder acts at a time."""

    name = models.CharField(max_length=50, primary_key=True)
    holder = models.CharField(max_length=100, blank=True, default="")
    expires_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.name} held by {self.holder or 'nobody'} until {self.expires_at}"


class ReconcileRun(models.Model):
    """The last reconcile pass that ran to its end (one row): when it started and how long it
    took. A kick older than its start was seen by it; a periodic pass waits a few of its
    durations after it (fleet.reconciler.reconcile_wanted)."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    started_at = models.DateTimeField()
    seconds = models.FloatField(default=0)

    def __str__(self) -> str:
        return f"reconcile pass at {self.started_at} ({self.seconds:.2f} s)"


class ModelFile(models.Model):
    """What a model file's GGUF header says about its memory, read once per file (source and
    sha256) so that placement can count the KV cache without asking the source every pass
    (fleet.footprint). ``error`` says why a header could not be read; it is asked again later."""

    key = models.CharField(max_length=64, unique=True, help_text="sha256 of source and sha256")
    source = models.TextField()
    weights_bytes = models.BigIntegerField(null=True, blank=True)
    kv_bytes_per_token = models.BigIntegerField(null=True, blank=True)
    trained_context = models.PositiveIntegerField(null=True, blank=True)
    # Its layers (the header's block_count): a profile offloading some of them reserves that
    # share of the weights and KV cache on its GPUs.
    block_count = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    read_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.source


class CapacitySample(models.Model):
    """What a node had and what its replicas reserved, at one minute (fleet.capacity)."""

    node = models.CharField(max_length=100)
    start = models.DateTimeField(help_text="the minute of the sample, UTC")
    memory_gb = models.FloatField(default=0)
    memory_reserved_gb = models.FloatField(default=0)
    cores = models.FloatField(default=0)
    cores_reserved = models.FloatField(default=0)
    replicas = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "start"], name="capacity_sample_once")
        ]
        indexes = [models.Index(fields=["start"])]

    def __str__(self) -> str:
        return f"{self.node} at {self.start:%Y-%m-%d %H:%M}"
