"""The Celery app: `celery -A llmgw_site worker` and `celery -A llmgw_site beat`."""

import logging
import os
import signal
import threading
import time
from typing import Any

from celery import Celery, bootsteps
from celery.signals import (
    beat_embedded_init,
    beat_init,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
)
from celery.worker import state as worker_state

from core.metrics import control_metrics, task_label
from llmgw.tracing import start_tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

# Every task is a PeriodicTask: a periodic send runs once, and only while it is the latest
# (llmgw_site.beat).
app = Celery("llmgw", task_cls="llmgw_site.beat:PeriodicTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

log = logging.getLogger("llmgw.beat")

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


@beat_embedded_init.connect
def _say_where_beat_runs(**_: object) -> None:
    log.info("beat: running inside the worker as process %s (worker -B)", os.getpid())


# The exit code of a worker whose embedded beat died (EX_SOFTWARE): not 0, so that a supervisor
# that restarts on failure (systemd's Restart=on-failure, the run command) starts it again.
BEAT_DIED_EXIT_CODE = 70
# How often a worker with -B looks whether its beat process is still alive.
BEAT_WATCH_SECONDS = 1.0


class WatchEmbeddedBeat(bootsteps.StartStopStep):
    """Under `worker -B`: when the beat process inside the worker dies, stop the worker.

    Why: Celery does not start an embedded beat again, and the worker stays up without it, so
    the schedule would stop with nothing noticing (no reconcile pass, no rollout step, no update
    check) until someone restarts the worker by hand. Stopped (a warm shutdown: running tasks
    end first) with BEAT_DIED_EXIT_CODE, the worker is started again by its supervisor with a
    new beat, which takes the lease once the dead one's runs out. Without -B it does nothing."""

    requires = ("celery.worker.components:Beat",)
    label = "WatchEmbeddedBeat"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.stopping = threading.Event()

    def start(self, parent: Any) -> None:
        beat = getattr(parent, "beat", None)
        if beat is None or getattr(beat, "pid", None) is None:
            return  # no -B, or a threaded beat (no process to watch)
        threading.Thread(
            target=self._watch, args=(beat,), name="watch-embedded-beat", daemon=True
        ).start()

    def stop(self, parent: Any) -> None:
        self.stopping.set()

    def _watch(self, beat: Any) -> None:
        while not self.stopping.wait(BEAT_WATCH_SECONDS):
            if _alive(beat):
                continue
            # A stop signal to the worker's process group reaches the beat too, which may exit
            # before the worker's own handler runs: a look later, that worker is stopping.
            if self.stopping.wait(BEAT_WATCH_SECONDS) or _worker_stopping():
                return
            log.error(
                "beat: the beat process inside this worker (pid %s) exited (code %s); stopping "
                "the worker with exit code %s so that its supervisor starts it again with a new "
                "beat (a worker does not restart its embedded beat; running beat as a process "
                "of its own avoids this)",
                beat.pid,
                beat.exitcode,
                BEAT_DIED_EXIT_CODE,
            )
            # Read by the worker's event loop at its next turn: a warm shutdown with that code.
            worker_state.should_stop = BEAT_DIED_EXIT_CODE
            return


def _worker_stopping() -> bool:
    return any(flag not in (None, False) for flag in (worker_state.should_stop,
                                                      worker_state.should_terminate))  # fmt: skip


def _alive(beat: Any) -> bool:
    """Whether the embedded beat's process runs: reaped by is_alive() when it has exited, or
    already gone (reaped elsewhere)."""
    if not beat.is_alive():
        return False
    try:
        os.kill(beat.pid, 0)
    except ProcessLookupError:
        return False
    return True


app.steps["worker"].add(WatchEmbeddedBeat)


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
