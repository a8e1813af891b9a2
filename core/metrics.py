"""Prometheus metrics of the control plane's work: reconcile passes, Celery tasks, fetches,
node heartbeats.

They are counted where the work happens, in the Celery worker's processes, and written (with
LLMGW_METRICS_DIR set, as the run command sets it for every process it starts) to the folder the
gateway's workers write theirs to, through prometheus_client's multiprocess mode: the gateway's
/metrics adds up every process's files, so a scrape shows the gateway's numbers and these
together. Without the folder each process counts for itself (tests, a lone process), and the
gateway's /metrics shows this process's own board beside its own (gateway.metrics).

Labels hold only names this code defines (outcomes, llmgw's task names), never input, so the
number of series is fixed.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from core.diskspace import allocate

# Seconds, from a pass over an empty catalog to an hour-long fetch.
WORK_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
# The packages whose tasks are counted by name; any other task is counted as "other".
TASK_PACKAGES = ("catalog.", "fleet.", "registry.", "gateway.", "accounts.", "llmgw_site.")


@dataclass(frozen=True)
class ControlPlaneFigures:
    """The control plane's state as /metrics shows it (access.selectors reads it; the gateway's /metrics shows it)."""

    rollouts: dict[str, int]  # state -> rollouts in it
    heartbeat_ages: dict[str, float | None]  # node -> seconds since its last heartbeat


def metrics_folder() -> str | None:
    """LLMGW_METRICS_DIR from the settings, else from the environment; None: single-process."""
    configured = getattr(settings, "LLMGW_METRICS_DIR", None)
    return str(configured) if configured else os.environ.get("LLMGW_METRICS_DIR") or None


def prepare(folder: str | None) -> Any:
    """Make prometheus_client write to `folder` (multiprocess mode) and return None, or return
    a registry of this process's own when there is no folder. Call before creating metrics."""
    # Imported here, never at the top: prometheus_client reads PROMETHEUS_MULTIPROC_DIR once,
    # when first imported, and the folder is set below first.
    from prometheus_client import CollectorRegistry, values

    if not folder:
        return CollectorRegistry(auto_describe=True)
    os.makedirs(folder, exist_ok=True)
    # prometheus_client picks its storage from this variable, once, when it is first imported;
    # set it and pick again, in case something imported it before.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    # Each value asks for the process's id at every change, to notice a fork: a system call
    # each time (ten a gateway request). The id is kept here instead, and taken again in a
    # forked child (gunicorn's and Celery's workers fork; the gateway's are spawned).
    values.ValueClass = values.MultiProcessValue(process_identifier=_own_pid)
    # Each process's file is written through a memory mapping: allocated, so that a full disk
    # is an OSError when a series is added, never SIGBUS (AllocatedFile).
    values.MmapedDict = _allocated_file()  # type: ignore[misc]
    return None


def _allocated_file() -> Any:
    """prometheus_client's MmapedDict with its file's blocks allocated before any write
    through the mapping (core.diskspace.allocate): as the library makes it, the file is
    sparse, and the first write to one of its pages when the disk holding LLMGW_METRICS_DIR
    is full killed the process (SIGBUS) when a new series was counted (a new status, say)."""
    from prometheus_client.mmap_dict import MmapedDict

    class AllocatedFile(MmapedDict):
        def __init__(self, filename: str, read_mode: bool = False) -> None:
            super().__init__(filename, read_mode)
            self._allocated = 0
            if not read_mode:
                allocate(self._f.fileno(), self._capacity)
                self._allocated = self._capacity

        def _init_value(self, key: str) -> None:
            # As the library grows the file for the entry (doubling), allocated first: the
            # entry takes its length (4 bytes), the key padded to 8 and two doubles.
            capacity = self._capacity
            while self._used + len(key.encode("utf-8")) + 36 > capacity:
                capacity *= 2
            if capacity > self._allocated:
                allocate(self._f.fileno(), capacity)
                self._allocated = capacity
            super()._init_value(key)

    return AllocatedFile


_pid = os.getpid()


def _own_pid() -> int:
    return _pid


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


@dataclass(frozen=True)
class ControlMetrics:
    reconcile_passes: Any
    reconcile_seconds: Any
    tasks: Any
    task_seconds: Any
    fetches: Any
    fetch_bytes: Any
    fetch_seconds: Any
    node_heartbeats: Any
    renewals_pending: Any
    autoscale_steps: Any
    registry: Any  # single-process mode: where the metrics are; multiprocess: None


_lock = threading.Lock()
_board: ControlMetrics | None = None


def control_metrics() -> ControlMetrics:
    """The control plane's metrics in this process, created on first use."""
    global _board
    if _board is None:
        with _lock:
            if _board is None:
                _board = _create(metrics_folder())
    return _board


def created() -> ControlMetrics | None:
    """The board if this process made one (single-process mode: what /metrics adds)."""
    return _board


def _create(folder: str | None) -> ControlMetrics:
    registry = prepare(folder)
    # After prepare(): prometheus_client reads PROMETHEUS_MULTIPROC_DIR once, when first imported.
    from prometheus_client import Counter, Gauge, Histogram

    where: dict[str, Any] = {"registry": registry}
    return ControlMetrics(
        reconcile_passes=Counter(
            "llmgw_reconcile_passes",
            "Reconcile passes by outcome: done, skipped (another pass held the lease) or failed.",
            ["outcome"],
            **where,
        ),
        reconcile_seconds=Histogram(
            "llmgw_reconcile_duration_seconds",
            "How long a reconcile pass took (skipped passes aside).",
            buckets=WORK_BUCKETS,
            **where,
        ),
        tasks=Counter(
            "llmgw_tasks",
            "Celery tasks run, by task name and outcome: succeeded, failed, retried or skipped "
            "(a periodic send superseded by a later one).",
            ["task", "outcome"],
            **where,
        ),
        task_seconds=Histogram(
            "llmgw_task_duration_seconds",
            "How long a Celery task ran, by task name.",
            ["task"],
            buckets=WORK_BUCKETS,
            **where,
        ),
        fetches=Counter(
            "llmgw_fetches",
            "Fetches of a registry's files into the mirror, by outcome: done or failed.",
            ["outcome"],
            **where,
        ),
        fetch_bytes=Counter(
            "llmgw_fetch_bytes",
            "Bytes downloaded from the registry into the mirror (files already there aside).",
            **where,
        ),
        fetch_seconds=Histogram(
            "llmgw_fetch_duration_seconds",
            "How long a fetch took, from its start to done or failed.",
            buckets=WORK_BUCKETS,
            **where,
        ),
        node_heartbeats=Counter(
            "llmgw_node_heartbeats",
            "Node heartbeats the web process answered: kind is full (a whole report) or renewal "
            "(liveness only); answer is unchanged (nothing to run changed), changed (the replicas "
            "to run sent in full) or report (the node was asked for its whole report).",
            ["kind", "answer"],
            **where,
        ),
        renewals_pending=Gauge(
            "llmgw_node_renewals_pending",
            "Renewals taken and not yet written (they are written together every second; at "
            "most fleet.liveness.MAX_PENDING per web process).",
            multiprocess_mode="livesum",
            **where,
        ),
        autoscale_steps=Counter(
            "llmgw_autoscale_steps",
            "Replica counts changed by a model's autoscale policy (fleet.autoscale), by model and "
            "direction: up (queue wait over the policy's for its up window) or down (a replica's "
            "worth unused for its down window).",
            ["model", "direction"],
            **where,
        ),
        registry=registry,
    )


def task_label(name: str | None) -> str:
    """A task's name as a label: llmgw's own tasks by name, anything else as "other"."""
    return name if name and name.startswith(TASK_PACKAGES) else "other"


def reset_for_tests() -> None:
    """Start over with a fresh board (each test sees only its own numbers)."""
    global _board
    with _lock:
        _board = None
