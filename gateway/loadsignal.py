"""What this gateway process tells the autoscaler (fleet.autoscale): its fair queue's figures
per model, written as its `LoadSignal` row every WRITE_SECONDS by the state refresher's thread.

A row holds, per model asked for since the last write: the waits that ended since then, in
fleet.autoscale.WAIT_BOUNDS buckets (a request that found a slot free is a wait of 0, one
refused by a full queue counts in the last bucket), plus the requests waiting now, each at the
age it has reached; how many wait now; and how many are in service. A write that fails (the
database away) drops that interval's waits: the next one says how things stand then.

Bound: one list of len(WAIT_BOUNDS) counts per model asked for since the last write (models
with a queue: fewer than gateway.fairqueue.MAX_QUEUES).
"""

from __future__ import annotations

import threading
import time

from django.utils import timezone

from fleet.autoscale import WAIT_BOUNDS, wait_bucket
from fleet.models import LoadSignal

from .fairqueue import FairQueue

WRITE_SECONDS = 5.0
_LAST = len(WAIT_BOUNDS) - 1


class LoadSignalBook:
    def __init__(self, queue: FairQueue, writer: str) -> None:
        self.queue = queue
        self.writer = writer[:64]
        self._lock = threading.Lock()
        self._waits: dict[str, list[int]] = {}
        self._written_at = float("-inf")

    def wait(self, model: str, seconds: float, outcome: str) -> None:
        """One request's end in the fair queue (its on_wait): served, timeout, gone or full."""
        bucket = _LAST if outcome == "full" else wait_bucket(seconds)
        with self._lock:
            counts = self._waits.get(model)
            if counts is None:
                counts = self._waits[model] = [0] * len(WAIT_BOUNDS)
            counts[bucket] += 1

    def due(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) - self._written_at >= WRITE_SECONDS

    def figures(self) -> dict[str, dict[str, object]]:
        """This interval's figures (and a new interval begun)."""
        with self._lock:
            waits, self._waits = self._waits, {}
        live = self.queue.load()
        figures: dict[str, dict[str, object]] = {}
        for model in waits.keys() | live.keys():
            counts = waits.get(model) or [0] * len(WAIT_BOUNDS)
            in_service, ages = live.get(model, (0, []))
            for age in ages:
                counts[wait_bucket(age)] += 1
            figures[model] = {"waits": counts, "waiting": len(ages), "in_service": in_service}
        return figures

    def write(self) -> None:
        """Write this process's row, every WRITE_SECONDS while it has anything to say: with
        nothing asked and nothing in service it writes nothing (an idle gateway does not write
        to the database every few seconds), and its row going stale says the same."""
        self._written_at = time.monotonic()
        figures = self.figures()
        if not figures:
            return
        LoadSignal.objects.update_or_create(
            writer=self.writer, defaults={"at": timezone.now(), "figures": figures}
        )

    def close(self) -> None:
        """At the process's stop: its row goes, so the autoscaler does not count it as there."""
        LoadSignal.objects.filter(writer=self.writer).delete()
