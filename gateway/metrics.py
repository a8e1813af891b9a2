"""Prometheus metrics of the gateway, served at /metrics.

The web runs as several worker processes, and a scrape reaches only one of them.
With LLMGW_METRICS_DIR set (a folder of its own, writable by every worker; empty it
when the web starts), each process writes its numbers to files there through
prometheus_client's multiprocess mode, and /metrics adds up every process's
files, so the numbers are the whole web's. Without it each process counts for
itself: right with a single worker process, wrong with several.

Labels hold only names from the catalog ("unknown" for anything else), so a
client cannot grow the number of series by asking for made-up models.
"""

from __future__ import annotations

import bisect
import functools
import glob
import os
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.diskspace import VarSpace
from core.metrics import ControlPlaneFigures, created, prepare

from . import conf
from .boards import process_alive


@dataclass(frozen=True)
class EngineFigures:
    """What one serving replica's engine last reported of itself (gateway.state reads them)."""

    model: str
    replica: str
    node: str
    numbers: dict[str, Any]


# Seconds, from a tiny model's few milliseconds to a long generation.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True)
class Metrics:
    requests: Any
    latency: Any
    tokens: Any
    in_flight: Any
    fallbacks: Any
    retries: Any
    refused: Any
    forward_held: Any
    forward_reading: Any
    forward_clients: Any
    forward_refused: Any
    forwarded_for_ignored: Any
    keys_held: Any
    key_refresh: Any
    limited: Any
    keys_limited: Any
    limit_slots_held: Any
    limits_redis_errors: Any
    limits_redis_dropped: Any
    limits_redis_fallback: Any
    limits_redis_down: Any
    replica_names: Any
    traffic_entries: Any
    key_uses_entries: Any
    demand_entries: Any
    snapshot_entries: Any
    replicas_reread: Any
    nodes_held: Any
    node_requests_waiting: Any
    node_requests_queued: Any
    node_requests_shed: Any
    prefix_entries: Any
    queue_flows_entries: Any
    limits_redis_pending_entries: Any
    queue_seconds: Any
    queue_depth: Any
    database_up: Any
    database_outages: Any
    access_log_lines: Any
    access_log_dropped: Any
    registry: Any  # single-process mode: where the metrics are; multiprocess: None
    folder: str | None


# The process's one board: prometheus_client keeps one set of metrics a process (in multiprocess
# mode, in files named by pid). The Gateway holds it and hands it on (gateway.process); only
# uvicorn's protocol (gateway.protocol), made outside any Gateway, asks for it here.
_lock = threading.Lock()
_metrics: Metrics | None = None


def metrics() -> Metrics:
    """The metrics of this process, created on first use (after settings are read)."""
    global _metrics
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = _create(conf.metrics_dir())
    return _metrics


@dataclass(frozen=True)
class MetricSpec:
    """One metric of the board: the Metrics attribute the code counts through, and what a
    scrape shows (its name, type, help and labels)."""

    attribute: str
    kind: str  # "counter", "gauge" or "histogram"
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only
    # Gauges only: how the processes' values add up in multiprocess mode.
    multiprocess_mode: str | None = None
    # Written by every request, from the event loop's thread only: its series write their
    # numbers through _LeanValue.
    lean: bool = False


# Every metric of the gateway, in the order a scrape shows them. The names, types and labels are
# what dashboards and alerts query: tests/gateway/test_metrics_table.py holds them.
GATEWAY_METRICS = (
    MetricSpec(
        "requests",
        "counter",
        "llmgw_gateway_requests",
        "Requests to /v1/, by the name asked for, the model that answered "
        "(a fallback, or empty when none did), endpoint and HTTP status.",
        labels=("model", "answered_by", "endpoint", "status"),
        lean=True,
    ),
    MetricSpec(
        "latency",
        "histogram",
        "llmgw_gateway_request_duration_seconds",
        "From the request's arrival to the last byte of the answer (waits for a replica included).",
        labels=("model", "endpoint"),
        buckets=LATENCY_BUCKETS,
        lean=True,
    ),
    MetricSpec(
        "tokens",
        "counter",
        "llmgw_gateway_tokens",
        "Tokens by the model that computed them; kind is prompt or completion. "
        "A stream counts what the engine said its answers had; one cut short, its prompt "
        "and a completion token per event sent (gateway.proxy.StreamTally).",
        labels=("model", "kind"),
        lean=True,
    ),
    MetricSpec(
        "in_flight",
        "gauge",
        "llmgw_gateway_requests_in_flight",
        "Requests being answered now, by the name asked for.",
        labels=("model",),
        multiprocess_mode="livesum",
        lean=True,
    ),
    MetricSpec(
        "fallbacks",
        "counter",
        "llmgw_gateway_fallbacks",
        "Requests answered by a fallback because the model asked for had no ready replica.",
        labels=("model", "fallback"),
    ),
    MetricSpec(
        "retries",
        "counter",
        "llmgw_gateway_retries",
        "Requests sent again to another replica after the first one went away.",
        labels=("model",),
    ),
    MetricSpec(
        "refused",
        "counter",
        "llmgw_gateway_refused",
        "Requests the gateway's HTTP protocol refused before any application saw them, by "
        "reason: head_too_large, too_many_headers, head_timeout (431, 431, 408), "
        "odd_request_line, bad_request, bad_chunked_body (400), too_many_connections "
        "(closed unread).",
        labels=("reason",),
    ),
    MetricSpec(
        "queue_seconds",
        "histogram",
        "llmgw_gateway_queue_seconds",
        "Seconds a request waited in the gateway's fair queue for a free slot (0 when one was "
        "free), by model and outcome: served, timeout (503), full (429), gone (hung up).",
        labels=("model", "outcome"),
        buckets=LATENCY_BUCKETS,
        lean=True,
    ),
    MetricSpec(
        "queue_depth",
        "gauge",
        "llmgw_gateway_queue_depth",
        "Requests waiting in the gateway's fair queue for a free slot of the model, every "
        "gateway process of the machine together.",
        labels=("model",),
        multiprocess_mode="livesum",
        lean=True,
    ),
    MetricSpec(
        "forward_held",
        "gauge",
        "llmgw_gateway_forward_body_bytes",
        "Bytes of request bodies for the web process held now (bounded per process by "
        "LLMGW_GATEWAY_FORWARD_MEMORY).",
        multiprocess_mode="livesum",
    ),
    MetricSpec(
        "forward_reading",
        "gauge",
        "llmgw_gateway_forward_bodies_reading",
        "Request bodies for the web process being read now, however few of their bytes "
        "have come (each within LLMGW_GATEWAY_BODY_DEADLINE and LLMGW_GATEWAY_BODY_MIN_RATE).",
        multiprocess_mode="livesum",
    ),
    MetricSpec(
        "forward_clients",
        "gauge",
        "llmgw_gateway_forward_clients_entries",
        "Client addresses whose request bodies for the web a gateway process holds bytes of "
        "now, each within LLMGW_GATEWAY_FORWARD_PER_CLIENT (at most one per open "
        "connection, LLMGW_GATEWAY_MAX_CONNECTIONS).",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "forward_refused",
        "counter",
        "llmgw_gateway_forward_refused",
        "Requests for the web process refused while their body was read, by reason: budget "
        "(503: LLMGW_GATEWAY_FORWARD_MEMORY is full, less its reserve for a big body), "
        "reserve (503: full, reserve included), client_share (503: the client address's "
        "LLMGW_GATEWAY_FORWARD_PER_CLIENT), pause, deadline, rate (408: "
        "LLMGW_GATEWAY_BODY_TIMEOUT, _DEADLINE, _MIN_RATE), too_large (413).",
        labels=("reason",),
    ),
    MetricSpec(
        "forwarded_for_ignored",
        "counter",
        "llmgw_gateway_forwarded_for_ignored",
        "Requests from a trusted proxy whose X-Forwarded-For named no address (the proxy's "
        "own address was taken as the client's).",
    ),
    MetricSpec(
        "keys_held",
        "gauge",
        "llmgw_gateway_keys_held",
        "Gateway keys of active users held in memory by a gateway process (about 140 bytes "
        "each; every process holds them all, capped by LLMGW_MAX_KEYS_PER_USER per user).",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "key_refresh",
        "histogram",
        "llmgw_gateway_key_refresh_seconds",
        "How long one read of the keys changed since the last read took.",
        buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
    ),
    MetricSpec(
        "limited",
        "counter",
        "llmgw_gateway_limited",
        "Requests refused by a key's or team's limit (subject: key or team), by limit: rpm, "
        "tpm, max_parallel (429 rate_limit_exceeded), tokens_per_day, tokens_per_month (429 "
        "insufficient_quota), expired (401), slots (503: this process's limit counters are "
        "all held, see llmgw_gateway_limit_slots_held).",
        labels=("limit", "subject"),
    ),
    MetricSpec(
        "keys_limited",
        "gauge",
        "llmgw_gateway_keys_limited",
        "Gateway keys with limits, a team, an expiry or a weight, held in memory beside the "
        "keys themselves (a few hundred bytes each).",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "limit_slots_held",
        "gauge",
        "llmgw_gateway_limit_slots_held",
        "Keys and teams with limits this process counts in its shared-memory file (at most "
        "gateway.limits.SLOTS each; a slot is given up when idle a minute and unused this month).",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "limits_redis_errors",
        "counter",
        "llmgw_gateway_limits_redis_errors",
        "Calls to Redis for the limits over several machines that failed (no answer within "
        "0.25 s, or refused); after one, the process counts alone for 5 s.",
    ),
    MetricSpec(
        "limits_redis_dropped",
        "counter",
        "llmgw_gateway_limits_redis_dropped",
        "Ends of requests not written to Redis because the queue of them was full (100,000 "
        "per process): each stays counted in flight until its process's name expires there.",
    ),
    MetricSpec(
        "limits_redis_fallback",
        "counter",
        "llmgw_gateway_limits_redis_fallback",
        "Requests of keys and teams counted in Redis (limited per minute or in flight) decided "
        "while Redis could not be reached, by LLMGW_LIMITS_REDIS_FALLBACK: alone (by this "
        "machine's own counts) or refuse (503).",
        labels=("fallback",),
    ),
    MetricSpec(
        "limits_redis_down",
        "gauge",
        "llmgw_gateway_limits_redis_down",
        "1 while a gateway process finds Redis unreachable for the limits and lets "
        "LLMGW_LIMITS_REDIS_FALLBACK decide; 0 once it reaches it again.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "database_up",
        "gauge",
        "llmgw_gateway_database_up",
        "1 when every gateway process reached the database at its last look, 0 while one "
        "serves from memory because it cannot (keys, models and replicas as last read).",
        multiprocess_mode="livemin",
    ),
    MetricSpec(
        "database_outages",
        "counter",
        "llmgw_gateway_database_outages",
        "Times a gateway process lost the database; what requests leave to write (traffic "
        "figures, last uses, idle clocks) is kept and written when it is back.",
    ),
    MetricSpec(
        "replica_names",
        "gauge",
        "llmgw_gateway_replica_names_entries",
        "Replicas whose last name served (a base model or an adapter) a gateway process "
        "remembers, to break ties towards the replica that will not switch (at most "
        "gateway.routing.MAX_REMEMBERED_REPLICAS, 1,000; past that the replicas with "
        "nothing in flight from the process are forgotten).",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "traffic_entries",
        "gauge",
        "llmgw_gateway_traffic_entries",
        "Entries of traffic figures a gateway process holds until they are written and over: "
        "minutes per model and revision, days per key and model, canary keys' minutes "
        "(access.traffic.TrafficBook).",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "key_uses_entries",
        "gauge",
        "llmgw_gateway_key_uses_entries",
        "Key ids a gateway process holds to write their last use: used since its last write "
        "(at most gateway.state.MAX_PENDING_USES, 100,000; past that a key's use waits for "
        "its next one) and written in the last minute or two (at most "
        "gateway.state.MAX_WRITTEN_USES, 100,000; past that the older half is forgotten).",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "demand_entries",
        "gauge",
        "llmgw_gateway_demand_entries",
        "On-demand models a gateway process holds to write their idle clock: at most two "
        "entries per on-demand model of the catalog.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "snapshot_entries",
        "gauge",
        "llmgw_gateway_snapshot_entries",
        "Rows of the routing snapshot a gateway process holds, keys aside "
        "(llmgw_gateway_keys_held): catalog names, replicas in routing, teams, budgets, "
        "unplaceable models and engines' figures; bounded by what the database holds.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "replicas_reread",
        "counter",
        "llmgw_gateway_replicas_reread",
        "Replicas a gateway process read again because its periodic look (every 60 s, on "
        "PostgreSQL) found their rows changed since it read them: a notification lost, or "
        "not yet taken.",
    ),
    MetricSpec(
        "nodes_held",
        "gauge",
        "llmgw_gateway_nodes_held",
        "Nodes a gateway process holds to answer their renewals itself (fleet.renewals): "
        "one small row per node the database holds, read again every second.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "node_requests_waiting",
        "gauge",
        "llmgw_gateway_node_requests_to_web",
        "Nodes' requests a gateway process has on their way to the web process, in flight or "
        "waiting for one of its connections (at most fleet.renewals.NODE_REQUESTS).",
        multiprocess_mode="livesum",
    ),
    MetricSpec(
        "node_requests_queued",
        "gauge",
        "llmgw_gateway_node_requests_queued",
        "Nodes' requests a gateway process holds waiting for a place on the way to the web "
        "(at most fleet.renewals.NODE_QUEUE, each for at most QUEUE_SECONDS).",
        multiprocess_mode="livesum",
    ),
    MetricSpec(
        "node_requests_shed",
        "counter",
        "llmgw_gateway_node_requests_shed",
        "Nodes' whole reports and renewals a gateway process answered 503 (come back later) "
        "instead of sending them to the web process, which had NODE_REQUESTS of them already and "
        "NODE_QUEUE more waiting, or which gave it no place within QUEUE_SECONDS; "
        "each node was renewed first, so none is lost for it.",
    ),
    MetricSpec(
        "prefix_entries",
        "gauge",
        "llmgw_gateway_prefix_entries",
        "Entries in use in the prefix table every gateway process of the machine shares "
        "(a fixed table of gateway.prefix.TABLE_ENTRIES, 65,536; a new prefix overwrites "
        "the one in its place). Counted when /metrics is read.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "queue_flows_entries",
        "gauge",
        "llmgw_gateway_queue_flows_entries",
        "Keys and teams (flows) with requests waiting or in service in a gateway process's "
        "fair queue, all models together (at most gateway.fairqueue.ENTRIES, 8,192: the "
        "requests its file tracks). Counted when /metrics is read.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "limits_redis_pending_entries",
        "gauge",
        "llmgw_gateway_limits_redis_pending_entries",
        "Ends of requests a gateway process holds to write to Redis (at most "
        "gateway.redislimits.MAX_PENDING, 100,000; past that the oldest is dropped and "
        "counted in llmgw_gateway_limits_redis_dropped). Counted when /metrics is read.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "access_log_lines",
        "counter",
        "llmgw_gateway_access_log_lines",
        "Lines a gateway process wrote to its access log (LLMGW_ACCESS_LOG), one per /v1/ "
        "request, in batches a few times a second.",
    ),
    MetricSpec(
        "access_log_dropped",
        "counter",
        "llmgw_gateway_access_log_dropped",
        "Access log lines a gateway process left unwritten: full (its buffer held "
        "gateway.accesslog.MAX_PENDING, 65,536, lines not yet written: the disk is too slow) "
        "or unwritable (the file could not be written: see the gateway's log).",
        labels=("reason",),
    ),
)


def _create(folder: str | None) -> Metrics:
    registry = prepare(folder)
    # After prepare(): prometheus_client reads PROMETHEUS_MULTIPROC_DIR once, when first imported.
    from prometheus_client import Counter, Gauge, Histogram

    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    made = {spec.attribute: _made(spec, kinds[spec.kind], registry) for spec in GATEWAY_METRICS}
    return Metrics(**made, registry=registry, folder=folder)


def _made(spec: MetricSpec, kind: Any, registry: Any) -> Any:
    # In multiprocess mode the registry only matters for collection, which reads the files.
    options: dict[str, Any] = {"registry": registry}
    if spec.buckets is not None:
        options["buckets"] = spec.buckets
    if spec.multiprocess_mode is not None:
        options["multiprocess_mode"] = spec.multiprocess_mode
    made = kind(spec.name, spec.help, spec.labels, **options)
    if spec.labels:
        _keep_children(made, lean=spec.lean)
    return made


def _keep_children(metric: Any, *, lean: bool = False) -> None:
    """`metric.labels(*values)` answered from a plain dict after the first call for `values`:
    prometheus_client's own look-up takes a lock and normalizes every value (about 2 µs, and a
    request asks for six). Bounded as the metric's series are (labels hold catalog names,
    outcomes and endpoints: see the module's doc); the gateway never removes a series.
    `lean`: each new series writes its file through _LeanValue."""
    children: dict[tuple[str, ...], Any] = {}
    find = metric.labels

    def labels(*values: str) -> Any:
        child = children.get(values)
        if child is None:
            child = children[values] = find(*values)
            if lean:
                _make_lean(child)
        return child

    metric.labels = labels


_TWO_DOUBLES = struct.Struct("dd").pack


class _LeanValue:
    """One series' number in multiprocess mode, written straight to its place in the process's
    file, as prometheus_client's own value writes it (the number and a timestamp, in one slice
    assignment, which a reader never sees half-written) but without its lock, its check for a
    fork on every write and its look-up of the place: a third of the cost of a request's nine
    writes (bench/gateway_profile.py).

    Only for the series of MetricSpec.lean: those the request path writes, from the event
    loop's thread alone (the lock guarded against two threads adding at once), in a process
    that uvicorn started rather than forked (the check reset the values of a forked child)."""

    __slots__ = ("_file", "_key", "_pos", "_value")
    _multiprocess = True

    def __init__(self, value: Any) -> None:
        self._file, self._key = value._file, value._key
        self._value = value._file.read_value(value._key)[0]  # gives the series its place
        self._pos = value._file._positions[value._key]

    def inc(self, amount: float) -> None:
        self._value += amount
        pos = self._pos
        # The file's mapping is made anew when the file grows (a new series): looked up each time.
        self._file._m[pos : pos + 16] = _TWO_DOUBLES(self._value, 0.0)

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value
        pos = self._pos
        self._file._m[pos : pos + 16] = _TWO_DOUBLES(value, timestamp or 0.0)

    def set_exemplar(self, exemplar: Any) -> None:
        return  # multiprocess mode keeps no exemplars

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> None:
        return None


def _make_lean(child: Any) -> None:
    """The child's values (a counter's or a gauge's, a histogram's sum and buckets) made
    _LeanValue; left as they are outside multiprocess mode (one process: nothing to write)."""
    for name in ("_value", "_sum"):
        value = getattr(child, name, None)
        if hasattr(value, "_file"):
            setattr(child, name, _LeanValue(value))
    value = getattr(child, "_value", None)
    if isinstance(value, _LeanValue):
        # A counter's or a gauge's inc (and a gauge's dec) straight to the value, with what
        # prometheus_client's own checks: a counter never goes down.
        if child._type == "counter":
            child.inc = functools.partial(_counter_inc, value)
        else:
            child.inc = functools.partial(_gauge_inc, value)
            child.dec = functools.partial(_gauge_dec, value)
    buckets = getattr(child, "_buckets", None)
    if buckets and hasattr(buckets[0], "_file"):
        child._buckets = [_LeanValue(bucket) for bucket in buckets]
        child.observe = functools.partial(
            _lean_observe, child._sum, child._buckets, tuple(child._upper_bounds)
        )


def _counter_inc(value: _LeanValue, amount: float = 1, exemplar: Any = None) -> None:
    if amount < 0:
        raise ValueError("Counters can only be incremented by non-negative amounts.")
    value.inc(amount)


def _gauge_inc(value: _LeanValue, amount: float = 1) -> None:
    value.inc(amount)


def _gauge_dec(value: _LeanValue, amount: float = 1) -> None:
    value.inc(-amount)


def _lean_observe(
    total: _LeanValue,
    buckets: list[_LeanValue],
    bounds: tuple[float, ...],
    amount: float,
    exemplar: Any = None,
) -> None:
    """A lean histogram's observe: as prometheus_client's (its sum, and the first bucket whose
    bound is at least `amount`: a multiprocess histogram keeps no count of its own, nor
    exemplars), found by bisection, and the sum left unwritten when 0 is added to it."""
    if amount:
        total.inc(amount)
    buckets[bisect.bisect_left(bounds, amount)].inc(1)


_LIVE_FILE = re.compile(r"gauge_live\w*?_(\d+)\.db$")


def exposition(
    current: Metrics | None = None, engines: Sequence[EngineFigures] = ()
) -> tuple[bytes, str]:
    """The text a scrape gets, and its content type: the gateway's own numbers (`current`, the
    process's board), then what each serving replica's engine last reported (``engines``, from
    the routing snapshot)."""
    # After metrics() has set PROMETHEUS_MULTIPROC_DIR (see _create).
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    current = current if current is not None else metrics()
    if current.folder is None:
        text = generate_latest(current.registry)
        # The control plane's numbers counted in this process, if any (core.metrics).
        control = created()
        if control is not None:
            text += generate_latest(control.registry)
    else:
        from prometheus_client import multiprocess  # as the import above: after the folder is set

        _forget_dead_processes(current.folder)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=current.folder)
        text = generate_latest(registry)
    return text + engine_exposition(engines), CONTENT_TYPE_LATEST


# The engines' numbers, as every gateway process reads them from the database (the heartbeat
# carries them there): not counted by this process, so not kept in prometheus_client's files,
# where several processes would add them up. (name, type, help, key in fleet's engine numbers)
ENGINE_METRICS = (
    (
        "llmgw_engine_tokens_per_second",
        "gauge",
        "Tokens the replica's engine generated per second over its last few seconds.",
        "tokens_per_second",
    ),
    ("llmgw_engine_slots", "gauge", "Requests the engine computes at once.", "slots"),
    ("llmgw_engine_slots_busy", "gauge", "Slots computing a request now.", "busy_slots"),
    ("llmgw_engine_requests_waiting", "gauge", "Requests waiting for a free slot.", "waiting"),
    (
        "llmgw_engine_predicted_tokens_total",
        "counter",
        "Tokens the engine generated since it started.",
        "predicted_tokens",
    ),
    (
        "llmgw_engine_prompt_tokens_total",
        "counter",
        "Prompt tokens the engine was sent since it started.",
        "prompt_tokens",
    ),
    (
        "llmgw_engine_prompt_tokens_cached_total",
        "counter",
        "Of those, the ones its prompt cache served without computing them again.",
        "prompt_tokens_cached",
    ),
)


def engine_exposition(engines: Sequence[EngineFigures]) -> bytes:
    """Prometheus text for the engines' numbers, labelled by model, replica and node."""
    lines = []
    for name, kind, text, key in ENGINE_METRICS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for engine in engines:
            value = engine.numbers.get(key)
            if value is None:
                continue
            labels = (
                f'model="{_label(engine.model)}",node="{_label(engine.node)}",'
                f'replica="{_label(engine.replica)}"'
            )
            lines.append(f"{name}{{{labels}}} {float(value)!r}")
    return ("\n".join(lines) + "\n").encode()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _forget_dead_processes(folder: str) -> None:
    """Drop the live gauges of worker processes that are gone (gunicorn replaced them).

    Counters and histograms of a gone process are kept: what it counted happened.
    """
    # After PROMETHEUS_MULTIPROC_DIR is set (see _create).
    from prometheus_client import multiprocess

    for path in glob.glob(os.path.join(folder, "gauge_live*_*.db")):
        match = _LIVE_FILE.search(os.path.basename(path))
        if match is None:
            continue
        pid = int(match.group(1))
        if not process_alive(pid):
            multiprocess.mark_process_dead(pid, folder)


def reset_for_tests() -> None:
    """Start over with fresh metrics (each test sees only its own numbers)."""
    global _metrics
    with _lock:
        _metrics = None


# The engines' numbers added up per model (every serving replica's): (name, help, key).
MODEL_METRICS = (
    (
        "llmgw_model_tokens_per_second",
        "Tokens the model's engines generate per second, all replicas.",
        "tokens_per_second",
    ),
    ("llmgw_model_slots", "Requests the model's engines compute at once, all replicas.", "slots"),
    (
        "llmgw_model_slots_busy",
        "Slots of the model's engines computing a request now.",
        "busy_slots",
    ),
    (
        "llmgw_model_requests_waiting",
        "Requests waiting for a free slot in the model's engines.",
        "waiting",
    ),
)


def model_exposition(engines: Sequence[EngineFigures]) -> bytes:
    """Prometheus text for the engines' numbers added up per model."""
    totals: dict[str, dict[str, float]] = {}
    for engine in engines:
        summed = totals.setdefault(engine.model, {})
        for _, _, key in MODEL_METRICS:
            value = engine.numbers.get(key)
            if isinstance(value, int | float):
                summed[key] = summed.get(key, 0.0) + float(value)
    lines = []
    for name, text, key in MODEL_METRICS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
        for model, figures in sorted(totals.items()):
            if key in figures:
                lines.append(f'{name}{{model="{_label(model)}"}} {figures[key]!r}')
    return ("\n".join(lines) + "\n").encode()


def control_plane_exposition(figures: ControlPlaneFigures) -> bytes:
    """Prometheus text for the control plane's state read at the scrape."""
    lines = [
        "# HELP llmgw_rollouts Rollouts (updates and rollbacks) in the database, by state.",
        "# TYPE llmgw_rollouts gauge",
        *(f'llmgw_rollouts{{state="{_label(s)}"}} {n}' for s, n in figures.rollouts.items()),
        "# HELP llmgw_node_heartbeat_age_seconds Seconds since the node's last heartbeat "
        "(absent for a node never heard).",
        "# TYPE llmgw_node_heartbeat_age_seconds gauge",
        *(
            f'llmgw_node_heartbeat_age_seconds{{node="{_label(node)}"}} {age!r}'
            for node, age in figures.heartbeat_ages.items()
            if age is not None
        ),
    ]
    return ("\n".join(lines) + "\n").encode()


def var_space_exposition(space: VarSpace | None) -> bytes:
    """Prometheus text for the room on the disk holding LLMGW_VAR_DIR, measured at the scrape
    (one statvfs call) on the gateway's machine: nothing when it cannot be measured."""
    if space is None:
        return b""
    lines = [
        "# HELP llmgw_var_free_bytes Bytes llmgw may still write on the disk holding "
        "LLMGW_VAR_DIR (the SQLite database, the mirror, the logs), at the scrape.",
        "# TYPE llmgw_var_free_bytes gauge",
        f"llmgw_var_free_bytes {space.room.free}",
        "# HELP llmgw_var_size_bytes Size of the disk holding LLMGW_VAR_DIR.",
        "# TYPE llmgw_var_size_bytes gauge",
        f"llmgw_var_size_bytes {space.room.total}",
        "# HELP llmgw_var_low_free 1 while llmgw_var_free_bytes is below LLMGW_VAR_LOW_FREE_MB "
        "(the run command warns, the console shows a banner), else 0.",
        "# TYPE llmgw_var_low_free gauge",
        f"llmgw_var_low_free {int(space.low)}",
    ]
    return ("\n".join(lines) + "\n").encode()
