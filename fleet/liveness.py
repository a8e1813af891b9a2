"""Node renewals, written together: one UPDATE a second for every node renewed, not one a node.

A renewal (services.node_renew) says only "this node is alive and nothing on it changed". Its
one effect is the node's last_heartbeat, which the reconciler reads to decide that a node is lost
(node_lost_after, 30 s by default). So each process that takes renewals keeps them in memory (its
`Liveness`), the earliest time per node, and writes them every FLUSH_SECONDS in one statement. A process that dies
loses at most that second of renewals: the nodes renew again at their next interval, long before
node_lost_after.

Bounded: at most MAX_PENDING nodes wait in one process (the keys are nodes that authenticated, so
the fleet's size bounds them anyway); past it a renewal writes the batch at once. The gauge
llmgw_node_renewals_pending shows how many wait.

With LLMGW_RENEWAL_FLUSH_SECONDS = 0 a renewal is written at once, in the request (tests that
look at the database right after a renewal).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from core.diskspace import disk_full, where_full
from core.metrics import control_metrics

from .models import Node

log = logging.getLogger("llmgw.fleet")

MAX_PENDING = 100_000
# A renewal skipped because another transaction held its node's row is tried again at the next
# write while it is younger than this (_write).
RETRY_SECONDS = 20.0


def flush_seconds() -> float:
    return float(settings.LLMGW_RENEWAL_FLUSH_SECONDS)


class Liveness:
    """The renewals one process took and has not written yet, and the thread that writes them.

    One per process that takes renewals: the web's, made with the fleet app (fleet.apps), and
    each gateway process's, made with its renewals (fleet.renewals.Renewals)."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self.pending: dict[int, datetime] = {}  # node id -> its earliest renewal not written
        self.flusher: threading.Thread | None = None
        self._lock = threading.Lock()

    def renewed(self, node_id: int, at: datetime) -> None:
        """Record that the node renewed at `at`; written within flush_seconds()."""
        if flush_seconds() <= 0:
            self._write({node_id: at})
            return
        with self._lock:
            # The earliest: the node is not claimed alive too long.
            self.pending.setdefault(node_id, at)
            full = len(self.pending) >= self.max_pending
            if self.flusher is None or not self.flusher.is_alive():
                self.flusher = threading.Thread(
                    target=self._flush_forever, name="renewals", daemon=True
                )
                self.flusher.start()
            control_metrics().renewals_pending.set(len(self.pending))
        if full:
            self.flush()

    def flush(self) -> int:
        """Write every pending renewal now; returns how many nodes were written."""
        with self._lock:
            batch = dict(self.pending)
            self.pending.clear()
            control_metrics().renewals_pending.set(0)
        if batch:
            self._write(batch)
        return len(batch)

    def _write(self, batch: dict[int, datetime]) -> None:
        """One UPDATE for the batch, at its earliest time. Only nodes not lost (a lost node
        comes back through a full report, which starts its heard_since again), and never back
        in time (a full report may have written a later time since).

        Rows another transaction holds are skipped, not waited for (PostgreSQL's SKIP LOCKED):
        waiting on a reconcile pass's rows, or another process's batch in another order, is how
        two batches deadlock. A skipped node's renewal waits for the next write, for at most
        RETRY_SECONDS: a pass that holds thousands of nodes' rows for a while (the nodes given a
        model of thousands of replicas) must not cost them their liveness until they are
        declared lost; past that, the node renews again anyway."""
        at = min(batch.values())
        ids = sorted(batch)
        skipped: set[int] = set()
        for start in range(0, len(ids), 5000):
            chunk = ids[start : start + 5000]
            if connection.vendor == "postgresql":
                free = _write_free(chunk, at)
                skipped.update(set(chunk) - free)  # held by another, or removed since
            else:  # no row locks to skip
                Node.objects.filter(pk__in=chunk, lost=False, last_heartbeat__lt=at).update(
                    last_heartbeat=at
                )
        if skipped and flush_seconds() > 0:
            oldest = timezone.now() - timedelta(seconds=RETRY_SECONDS)
            with self._lock:
                for pk in skipped:
                    if batch[pk] >= oldest:
                        self.pending.setdefault(pk, batch[pk])
                control_metrics().renewals_pending.set(len(self.pending))

    def _flush_forever(self) -> None:
        full = False  # the database's disk was full at the last write: said once, not a second
        while True:
            time.sleep(flush_seconds() or 1.0)
            try:
                close_old_connections()
                if self.flush() and full:
                    log.warning("node renewals are written again: the database has room")
                    full = False
            except Exception as exc:
                # The database may be away for a moment; the renewals of this second are lost
                # (the nodes renew again) and the next second is tried as usual.
                found = disk_full(exc)
                if found is None:
                    log.exception("writing node renewals failed")
                elif not full:
                    log.warning(
                        "node renewals are not written: %s; tried again every second",
                        where_full(found).text(),
                    )
                    full = True
                connection.close()


# One statement, so that the rows are held only while it runs: a transaction of two (the
# locking SELECT, then the UPDATE) held them across a round trip and whatever the writing
# thread waited for in between, and heartbeats writing those nodes' rows waited as long.
_WRITE_FREE = f"""
WITH free AS (
    SELECT id FROM {Node._meta.db_table} WHERE id = ANY(%s) ORDER BY id FOR UPDATE SKIP LOCKED
), written AS (
    UPDATE {Node._meta.db_table} SET last_heartbeat = %s
    WHERE id IN (SELECT id FROM free) AND NOT lost AND last_heartbeat < %s
)
SELECT id FROM free
"""


def _write_free(ids: list[int], at: datetime) -> set[int]:
    """Write `at` to the nodes of `ids` no other transaction holds; the ids of those."""
    with connection.cursor() as cursor:
        cursor.execute(_WRITE_FREE, [ids, at, at])
        return {pk for (pk,) in cursor.fetchall()}
