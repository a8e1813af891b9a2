"""The Celery app: `celery -A llmgw_site worker` and `celery -A llmgw_site beat`."""

import os
import signal
import threading
import time

from celery import Celery
from celery.signals import beat_init, task_postrun, task_prerun, worker_init, worker_process_init

from core.metrics import control_metrics, task_label
from llmgw.tracing import start_tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

# Every task is a PeriodicTask: a periodic send runs once, and only while it is the latest
# (llmgw_site.beat).
app = Celery("llmgw", task_cls="llmgw_site.beat:PeriodicTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# What the worker's pool processes and beat trace when OTEL_EXPORTER_OTLP_ENDPOINT is set
# (llmgw.tracing): the tasks, and what they send to the database, Redis and over HTTP.
TRACED = ("celery", "requests", "psycopg", "redis")


@worker_process_init.connect
def _start_tracing_in_pool_process(**_: object) -> None:
    # In each pool process, after the fork: the tasks run there.
    start_tracing("llmgw-worker", TRACED)


@worker_init.connect
def _apply_config_on_worker_start(**_: object) -> None:
    # Here: startup reaches models, and this module is loaded before Django's apps.
    from .startup import apply_config_on_start

    apply_config_on_start("worker")


@beat_init.connect
def stop_on_signal(**_: object) -> None:
    """In a beat process, SIGTERM and SIGINT only raise SystemExit: Service.start's `finally`
    closes the scheduler (releasing the lease) once the code the signal cut has unwound.

    Celery's own handler closes the scheduler inside the handler, that is in the middle of
    whatever the beat was doing: when that was a query (a renewal waiting on a row lock), the
    release needs the same connection, whose lock the cut query holds, and the beat hangs until
    it is killed."""
    if threading.current_thread() is not threading.main_thread():
        return  # a beat thread inside a worker (-B): the worker handles its signals

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


@beat_init.connect
def _apply_config_on_beat_start(**_: object) -> None:
    start_tracing("llmgw-beat", TRACED)
    # Here: startup reaches models, and this module is loaded before Django's apps.
    from .startup import apply_config_on_start

    apply_config_on_start("beat")


# Task id -> when it started, in this process: one entry per task running in it (a pool process
# runs one at a time), removed when it ends.
_started: dict[str, float] = {}
_OUTCOMES = {"SUCCESS": "succeeded", "FAILURE": "failed", "RETRY": "retried", "IGNORED": "skipped"}


@task_prerun.connect
def _task_started(task_id: str | None = None, **_: object) -> None:
    if task_id:
        _started[task_id] = time.monotonic()


@task_postrun.connect
def _task_ended(
    task_id: str | None = None, task: object = None, state: str | None = None, **_: object
) -> None:
    """Counted in llmgw_tasks_total by name and outcome, timed in llmgw_task_duration_seconds."""
    started = _started.pop(task_id or "", None)
    name = task_label(getattr(task, "name", None))
    board = control_metrics()
    board.tasks.labels(name, _OUTCOMES.get(state or "", (state or "unknown").lower())).inc()
    if started is not None:
        board.task_seconds.labels(name).observe(time.monotonic() - started)
