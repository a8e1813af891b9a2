"""What the gateway routes by, kept in each gateway process's memory.

A request reads nothing from the database: the catalog, the replicas in routing,
the gateway keys (their hashes) and which on-demand models fit on no node are a
`Snapshot` held here, replaced whole when something changed. A thread of its own
in each process (`Refresher`) learns of changes from the database itself (see
gateway.triggers): on PostgreSQL by LISTEN, delivered when the change commits; on
SQLite by reading one version number every POLL_SECONDS. It reads everything
again then, and every SAFETY_SECONDS anyway, in case a notification was lost
(a dropped connection). A revoked key stops working, and a withdrawn replica
gets no new request, within about POLL_SECONDS plus one read (tens of
milliseconds on PostgreSQL) — well inside the drain that keeps a withdrawn
replica running (fleet.services.DRAIN_SECONDS).

The writes a request implies are made by the same thread, off the request's
path: an on-demand model's idle clock (and waking it), and a key's last use.

Something not found (a key, a model name) may simply be newer than the copy: the
request then waits for the refresher's next look (at most POLL_SECONDS) before
it is refused. Refusals of made-up keys therefore cost the database nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import close_old_connections, connection

from . import traffic, triggers
from .routing import Candidate, Catalog, Entry, read_catalog, read_replicas

if TYPE_CHECKING:
    from fleet.footprint import Footprint

log = logging.getLogger("llmgw.gateway")

POLL_SECONDS = 0.05
SAFETY_SECONDS = 5.0
# A key's last use is written at most this often per key and process.
LAST_USED_SECONDS = 60.0


@dataclass(frozen=True)
class KeyState:
    id: int
    active: bool


@dataclass(frozen=True)
class Snapshot:
    catalog: Catalog
    replicas: dict[str, list[Candidate]]
    keys: dict[str, KeyState]  # by hash
    unplaceable: dict[str, str]  # on-demand model -> why it fits on no node
    # What each serving replica's engine last reported of itself (fleet.selectors), for /metrics.
    engines: tuple[EngineFigures, ...] = ()
    read_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class EngineFigures:
    model: str
    replica: str
    node: str
    numbers: dict[str, Any]


def read_snapshot() -> Snapshot:
    """Everything routing and /metrics need, in six queries."""
    from .models import GatewayKey

    catalog = read_catalog()
    replicas = read_replicas()
    keys = {
        key_hash: KeyState(id=key_id, active=revoked_at is None)
        for key_hash, key_id, revoked_at in GatewayKey.objects.order_by().values_list(
            "key_hash", "id", "revoked_at"
        )
    }
    return Snapshot(
        catalog=catalog,
        replicas=replicas,
        keys=keys,
        unplaceable=_unplaceable(catalog),
        engines=_engines(),
    )


def _engines() -> tuple[EngineFigures, ...]:
    """The serving replicas' engine numbers, fresh ones only (fleet.selectors.engine_numbers)."""
    from fleet.models import Replica
    from fleet.selectors import engine_numbers

    figures = []
    for replica in (
        Replica.objects.filter(withdrawn_at__isnull=True, state=Replica.READY, model__isnull=False)
        .exclude(engine_metrics_at__isnull=True)
        .select_related("node")
        .only(
            "id",
            "model_name",
            "state",
            "withdrawn_at",
            "slots",
            "engine_metrics",
            "engine_metrics_at",
            "node__name",
        )
        .order_by("model_name", "id")
    ):
        numbers = engine_numbers(replica)
        if numbers is not None:
            figures.append(
                EngineFigures(replica.model_name, str(replica.pk), replica.node.name, numbers)
            )
    return tuple(figures)


def _unplaceable(catalog: Catalog) -> dict[str, str]:
    """On-demand models none of whose profiles fits on any schedulable node, even an empty one."""
    from catalog.models import Model
    from fleet.footprint import known_facts, model_footprints
    from fleet.models import Node

    on_demand = [e.name for e in catalog.entries.values() if e.on_demand and not e.adapter]
    if not on_demand:
        return {}
    nodes = [
        n
        for n in Node.objects.order_by().only(
            "memory_gb", "cores", "gpus", "gpu_memory_gb", "cordoned", "lost", "last_heartbeat"
        )
        if n.schedulable
    ]
    why: dict[str, str] = {}
    models = list(
        Model.objects.order_by()
        .filter(name__in=on_demand)
        .only("name", "profiles", "source", "sha256", "context_length")
    )
    facts = known_facts(models)
    for model in models:
        name = model.name
        if not nodes:
            why[name] = (
                "no node is ready to run it (none has sent a heartbeat, or all are cordoned or lost)"
            )
            continue
        profiles = list(zip(model.profiles, model_footprints(model, facts[name]), strict=True))
        if any(_fits(profile, memory, node) for profile, memory in profiles for node in nodes):
            continue
        largest = max(nodes, key=lambda n: (n.memory_gb, n.cores))
        needs = "; ".join(_describe(p, memory) for p, memory in profiles) or "no profile"
        why[name] = (
            f"it fits on no node: its profiles need {needs}, and the largest node has "
            f"{largest.memory_gb:g} GB and {largest.cores:g} cores"
            + (f", {largest.gpus} GPUs" if largest.gpus else "")
        )
    return why


def _fits(profile: dict[str, Any], memory: Footprint, node: Any) -> bool:
    return (
        memory.memory_gb <= node.memory_gb
        and float(profile.get("cores") or 0) <= node.cores
        and int(profile.get("gpus") or 0) <= node.gpus
        and float(profile.get("gpu_memory_gb") or 0) <= node.gpu_memory_gb
    )


def _describe(profile: dict[str, Any], memory: Footprint) -> str:
    text = f"{profile.get('name', '?')}: {memory.memory_gb:g} GB, {float(profile.get('cores') or 0):g} cores"
    if profile.get("gpus"):
        text += f", {profile['gpus']} GPUs"
    return text


class GatewayState:
    """The current snapshot, the refresher that replaces it, and the writes waiting for it."""

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # monotonic time of the refresher's last look at the database (None: no refresher)
        self.looked_at: float | None = None
        self._demand: dict[str, tuple[Entry, bool]] = {}
        self._used: set[int] = set()
        self._used_written: dict[int, float] = {}

    # -- reads, on the request's path ---------------------------------------------------

    def get(self) -> Snapshot:
        snapshot = self._snapshot
        if snapshot is None:
            # Only before the refresher's first read (and in tests): read it here, once.
            with self._lock:
                if self._snapshot is None:
                    self._snapshot = read_snapshot()
                snapshot = self._snapshot
        return snapshot

    def looked_since(self, moment: float) -> bool:
        """Has the refresher looked at the database since `moment` (or is there none to wait for)?"""
        return self.looked_at is None or self.looked_at > moment

    # -- what requests leave to write -----------------------------------------------------

    def asked_for(self, entry: Entry, *, nothing_ready: bool) -> None:
        if not entry.on_demand:
            return
        with self._lock:
            _, already = self._demand.get(entry.model, (entry, False))
            self._demand[entry.model] = (entry, already or nothing_ready)
        if nothing_ready:
            self._wake.set()

    def key_used(self, key_id: int) -> None:
        self._used.add(key_id)

    def flush(self) -> None:
        """Write what requests left: idle clocks (waking on-demand models) and keys' last use."""
        from . import services

        with self._lock:
            demand, self._demand = self._demand, {}
        for entry, nothing_ready in demand.values():
            services.model_asked_for(entry, nothing_ready=nothing_ready)
        used, self._used = self._used, set()
        now = time.monotonic()
        due = [
            key_id
            for key_id in used
            if now - self._used_written.get(key_id, -LAST_USED_SECONDS) >= LAST_USED_SECONDS
        ]
        if due:
            services.keys_used(due)
            for key_id in due:
                self._used_written[key_id] = now
        if traffic.book.due():
            try:
                traffic.book.flush()
            except Exception:
                # Figures are kept for the next flush; routing must not wait on them.
                log.exception("gateway: could not write traffic figures; trying again later")

    # -- the refresher ------------------------------------------------------------------

    def reload(self) -> Snapshot:
        snapshot = read_snapshot()
        self._snapshot = snapshot
        return snapshot

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="llmgw-gateway-state", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.looked_at = None

    def _run(self) -> None:
        watcher: _Watcher | None = None
        while not self._stop.is_set():
            try:
                if watcher is None:
                    watcher = _watcher()
                    self.reload()
                    self.looked_at = time.monotonic()
                changed = watcher.changed(POLL_SECONDS, self._wake)
                self._wake.clear()
                snapshot = self._snapshot
                stale = snapshot is None or time.monotonic() - snapshot.read_at >= SAFETY_SECONDS
                if changed or stale:
                    self.reload()
                self.looked_at = time.monotonic()
                self.flush()
            except Exception:
                # The database is away, or a connection broke: keep serving from memory, and
                # start over (a new connection, a full read) in a moment.
                log.exception("gateway: could not refresh routing state; serving from memory")
                if watcher is not None:
                    watcher.close()
                watcher = None
                close_old_connections()
                connection.close()
                self._stop.wait(1.0)
        if watcher is not None:
            watcher.close()
        connection.close()


class _Watcher:
    def changed(self, timeout: float, wake: threading.Event) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _VersionPoll(_Watcher):
    """SQLite (and any other database): read the version row the triggers bump."""

    def __init__(self) -> None:
        self.version = self._read()

    def _read(self) -> int:
        # Straight on the database driver's connection: Django's cursor costs ten times the
        # query, and this runs twenty times a second in every gateway process.
        connection.ensure_connection()
        assert connection.connection is not None
        cursor = connection.connection.cursor()
        try:
            cursor.execute("SELECT version FROM gateway_routingversion WHERE id = 1")
            row = cursor.fetchone()
        finally:
            cursor.close()
        return int(row[0]) if row else 0

    def changed(self, timeout: float, wake: threading.Event) -> bool:
        wake.wait(timeout)
        version = self._read()
        if version == self.version:
            return False
        self.version = version
        return True


class _Listen(_Watcher):
    """PostgreSQL: LISTEN on a connection of its own; notifications come when changes commit."""

    def __init__(self) -> None:
        import psycopg

        params = connection.get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        params.pop("prepare_threshold", None)
        self.conn = psycopg.connect(**params, autocommit=True)
        self.conn.execute(f"LISTEN {triggers.CHANNEL}")

    def changed(self, timeout: float, wake: threading.Event) -> bool:
        got = False
        for _ in self.conn.notifies(timeout=timeout, stop_after=1):
            got = True
        if got:
            # Take the rest of a burst at once: one read for all of them.
            for _ in self.conn.notifies(timeout=0.01):
                pass
        return got

    def close(self) -> None:
        self.conn.close()


def _watcher() -> _Watcher:
    connection.ensure_connection()
    if connection.vendor == "postgresql":
        return _Listen()
    return _VersionPoll()


state = GatewayState()
