"""A fetch from start to end: its files into the mirror, then what was waiting for them (the
model a `serve` adds, the rollout that swaps to them). This is what the worker runs."""

from __future__ import annotations

from datetime import datetime, timedelta

from core.dbclock import database_ago
from llmgw.tracing import continued, enabled, mark_failed

from . import holders, mirror
from .models import Fetch, Rollout
from .queue import queue_now
from .rollouts import advance_rollouts
from .updates import finish_serve

# A `model serve` fetch that no worker has taken this long after it was queued is queued again.
RESUME_AFTER_SECONDS = 30
RESUMED_PER_PASS = 20


def run_fetch(fetch_id: int) -> None:
    """Safe to run twice, or beside another worker: a fetch is claimed before it is run. An
    update's fetch is a span of its rollout's trace (llmgw.tracing)."""
    if not mirror.claim_fetch(fetch_id):
        return  # another worker runs it, or it is finished
    trace = None
    if enabled():  # nothing read for a trace while tracing is off
        trace = Rollout.objects.filter(fetch_id=fetch_id).values_list("trace", flat=True).first()
    with continued(trace or "", "fetch", {"llmgw.fetch": fetch_id}) as span:
        mirror.download(fetch_id, claimed=True)
        if span is not None:
            fetch = Fetch.objects.get(pk=fetch_id)
            span.set_attributes(
                {"llmgw.fetch.state": fetch.state, "llmgw.fetch.bytes": fetch.bytes_done}
            )
            if fetch.state == Fetch.FAILED:
                mark_failed(span, fetch.message)
    fetch = Fetch.objects.get(pk=fetch_id)
    if fetch.serve_definition is not None:
        finish_serve(fetch)
    advance_rollouts()


def release_abandoned(*, now: datetime | None = None) -> list[int]:
    """Queue again at once the running fetches whose worker process is gone from this machine
    (registry.holders.is_gone: a worker killed, or restarted), without waiting for their lease to
    lapse; a worker takes each at most once (Fetch.release, then Fetch.claim). A holder on another
    machine is left to its lease. The ids queued. By the database's clock unless a test gives
    `now`."""
    running = Fetch.objects.filter(state=Fetch.RUNNING).exclude(holder="")
    released = [
        fetch_id
        for fetch_id, holder in running.values_list("pk", "holder")[:RESUMED_PER_PASS]
        if holders.is_gone(holder) and Fetch.release(fetch_id, holder, now=now)
    ]
    for fetch_id in released:
        queue_now("registry.tasks.run_fetch", fetch_id)
    return released


def resume_interrupted(*, now: datetime | None = None) -> list[int]:
    """Queue again the `model serve` fetches that nobody runs: left queued (the message was lost:
    the broker restarted, or an upgrade renamed the task) or running with their lease lapsed.
    An update's fetch needs none of this: its rollout queues it again (rollouts.py). Each is
    marked as queued now, so the next passes leave it alone for RESUME_AFTER_SECONDS; a worker
    takes it at most once (Fetch.claim). The ids queued. By the database's clock, which stamps
    the heartbeats, unless a test gives `now`."""
    due = (
        database_ago(RESUME_AFTER_SECONDS)
        if now is None
        else now - timedelta(seconds=RESUME_AFTER_SECONDS)
    )
    serves = Fetch.objects.filter(serve_definition__isnull=False)
    resumable = serves.left_queued(due) | serves.orphaned(now)
    ids = list(resumable.order_by("pk").values_list("pk", flat=True)[:RESUMED_PER_PASS])
    resumable.filter(pk__in=ids).requeue(now)
    for fetch_id in ids:
        queue_now("registry.tasks.run_fetch", fetch_id)
    return ids
