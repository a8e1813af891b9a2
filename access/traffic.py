"""Traffic over time: per model and minute, and per key, model and day, kept in the database.

A request adds its figures to this process's `TrafficBook` in memory (no I/O); the gateway's
state thread writes it every FLUSH_SECONDS. Each process writes only rows of its own (`writer`)
with the absolute totals it holds, so processes never race on a counter and a repeated write
changes nothing; `fold()` keeps the tables bounded. Besides requests, the rows hold the fair
queue's waits, each minute's slowest answer and, for a model under a canary update, its answers
per key and revision. What is kept, and for how long: docs/gateway.md#traffic-figures-and-usage.
"""

from __future__ import annotations

import functools
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q

from registry.models import CanaryKeyMinute

from . import live
from .models import GatewayKey, KeyUsageDay, TrafficMinute

# Canary key minutes are kept as long as the longest canary window (registry.canary's
# MAX_WINDOW_SECONDS), then deleted by fold().
CANARY_KEYS_KEEP = timedelta(days=1, minutes=2)
# Upper bounds (seconds) of the latency histogram kept per minute; the last one is open.
LATENCY_BOUNDS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, math.inf,
)  # fmt: skip
FLUSH_SECONDS = 5.0
TRAFFIC_KEEP_DAYS = 8
KEY_USAGE_KEEP_DAYS = 400
MINUTE = 60
HOUR = 3600


def _writer_name() -> str:
    # pid alone can come back after a restart: the random part keeps two lives apart.
    return f"{socket.gethostname()[:20]}-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass
class Figures:
    """The sums one row holds."""

    requests: int = 0
    client_errors: int = 0
    server_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BOUNDS))
    # The fair queue's waits (gateway.fairqueue), counted when a wait ends, in that minute's row
    # of revision "" (no replica has answered it yet) under the model whose slots were busy: how
    # many waited, their seconds summed and the longest, and how many timed out or were refused
    # as the queue was full. A request that went straight through costs nothing. The longest
    # rather than a histogram (/metrics has llmgw_gateway_queue_seconds): "how many waited, how
    # long on average, how long at worst" is what the model page asks, and the longest of several
    # rows is their largest, so folding and reading stay exact.
    queued: int = 0
    queue_seconds: float = 0.0
    queue_seconds_max: float = 0.0
    queue_timeouts: int = 0
    queue_full: int = 0
    # The slowest answer and its request's ID (core.requestid: named in the gateway's log lines
    # and, as llmgw.request_id, in its traces), so that a slow point on a chart leads to one
    # request to look up. One comparison a request; of several rows it is the slowest of theirs.
    slowest_seconds: float = 0.0
    slowest_request: str = ""

    def add_request(
        self, status: int, seconds: float, prompt: int, completion: int, request_id: str = ""
    ) -> None:
        self.requests += 1
        if seconds > self.slowest_seconds:
            self.slowest_seconds = seconds
            self.slowest_request = request_id
        if 400 <= status < 500:
            self.client_errors += 1
        elif status >= 500:
            self.server_errors += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.seconds += seconds
        for index, bound in enumerate(LATENCY_BOUNDS):
            if seconds <= bound:
                self.latency_buckets[index] += 1
                break

    def add(self, other: Figures | dict[str, Any]) -> None:
        values = other if isinstance(other, dict) else other.__dict__
        self.requests += values["requests"]
        self.client_errors += values["client_errors"]
        self.server_errors += values["server_errors"]
        self.prompt_tokens += values["prompt_tokens"]
        self.completion_tokens += values["completion_tokens"]
        self.seconds += values["seconds"]
        for index, count in enumerate(values["latency_buckets"] or ()):
            if index < len(self.latency_buckets):
                self.latency_buckets[index] += count
        self.queued += values["queued"]
        self.queue_seconds += values["queue_seconds"]
        # The longest wait of several rows (writers, minutes) is the longest of theirs.
        self.queue_seconds_max = max(self.queue_seconds_max, values["queue_seconds_max"])
        self.queue_timeouts += values["queue_timeouts"]
        self.queue_full += values["queue_full"]
        # The slowest answer of several rows is the slowest of theirs, with its ID.
        if values["slowest_seconds"] > self.slowest_seconds:
            self.slowest_seconds = values["slowest_seconds"]
            self.slowest_request = values["slowest_request"]

    def add_wait(self, seconds: float, outcome: str) -> None:
        """One request's end in the fair queue (an outcome of gateway.fairqueue's on_wait:
        served, timeout, gone or full). Refused as full, it never waited."""
        if outcome == "full":
            self.queue_full += 1
            return
        self.queued += 1
        self.queue_seconds += seconds
        self.queue_seconds_max = max(self.queue_seconds_max, seconds)
        if outcome == "timeout":
            self.queue_timeouts += 1

    @property
    def queue_seconds_mean(self) -> float | None:
        """The mean wait of the requests that waited; None when none did."""
        return self.queue_seconds / self.queued if self.queued else None

    @property
    def latency_p50(self) -> float | None:
        return self.latency(0.5)

    @property
    def latency_p95(self) -> float | None:
        return self.latency(0.95)

    def copy(self) -> Figures:
        return Figures(**{**self.__dict__, "latency_buckets": list(self.latency_buckets)})

    def latency(self, quantile: float) -> float | None:
        """The latency below which `quantile` of the answers came, interpolated within a bucket."""
        total = sum(self.latency_buckets)
        if total == 0:
            return None
        rank = quantile * total
        seen = 0
        lower = 0.0
        for bound, count in zip(LATENCY_BOUNDS, self.latency_buckets, strict=True):
            if count and seen + count >= rank:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - seen) / count
            seen += count
            lower = bound if not math.isinf(bound) else lower
        return lower


class TrafficBook:
    """This process's figures, added to by requests and written by flush().

    Its bound is one of time, not of count: once written, it holds the minutes not yet final
    (this one and the last, per model and revision), the days of today and yesterday (per key
    and model that sent anything) and, for a canary, its keys' minutes. What the database has not
    taken yet is held until it has (size() says how much; llmgw_gateway_traffic_entries).
    """

    def __init__(self, writer: str | None = None) -> None:
        self.writer = writer or _writer_name()
        self._lock = threading.Lock()
        self._minutes: dict[tuple[str, str, int], Figures] = {}
        self._days: dict[tuple[int, str, date], list[int]] = {}
        self._dirty_minutes: set[tuple[str, str, int]] = set()
        self._dirty_days: set[tuple[int, str, date]] = set()
        # (model, revision, key id, minute) -> [requests, server errors, seconds], only for a
        # model with a canary update under way, so that its check can tell errors that follow a
        # key's requests from errors that follow the new revision (registry.canary.judge). In
        # memory: keys x 2 revisions x the 2 minutes not yet final, per such model; in the
        # database (CanaryKeyMinute), keys x 2 revisions x the window's minutes, per writer.
        self._canary_keys: dict[tuple[str, str, int, int], list[float]] = {}
        self._dirty_canary_keys: set[tuple[str, str, int, int]] = set()
        self._flushed_at = 0.0

    def record(
        self,
        *,
        model: str,
        key_id: int | None,
        status: int,
        seconds: float,
        prompt: int = 0,
        completion: int = 0,
        at: float | None = None,
        revision: str = "",
        canary: bool = False,
        request_id: str = "",
    ) -> None:
        """Count one answered request. `canary`: the model has a canary update under way, so
        the answer is also counted per key and revision (for the canary's check). `request_id`:
        its ID, kept while it is the slowest answer of its minute."""
        at = time.time() if at is None else at
        minute = (model, revision, int(at // MINUTE) * MINUTE)
        with self._lock:
            if canary and revision and key_id is not None:
                by_key = (model, revision, key_id, minute[2])
                counts = self._canary_keys.get(by_key)
                if counts is None:
                    counts = self._canary_keys[by_key] = [0, 0, 0.0]
                counts[0] += 1
                counts[1] += status >= 500
                counts[2] += seconds
                self._dirty_canary_keys.add(by_key)
            figures = self._minutes.get(minute)
            if figures is None:
                figures = self._minutes[minute] = Figures()
            figures.add_request(status, seconds, prompt, completion, request_id)
            self._dirty_minutes.add(minute)
            if key_id is not None:
                day = (key_id, model, _utc_date(at))
                usage = self._days.get(day)
                if usage is None:
                    usage = self._days[day] = [0, 0, 0]
                usage[0] += 1
                usage[1] += prompt
                usage[2] += completion
                self._dirty_days.add(day)

    def record_wait(
        self, *, model: str, seconds: float, outcome: str, at: float | None = None
    ) -> None:
        """Count one request's time in the fair queue (gateway.fairqueue's on_wait). A request
        that found a slot free and nobody waiting is reported as served after 0 seconds: it did
        not queue, and is not counted (nor does it take the lock)."""
        if outcome == "served" and seconds <= 0:
            return
        at = time.time() if at is None else at
        minute = (model, "", int(at // MINUTE) * MINUTE)
        with self._lock:
            figures = self._minutes.get(minute)
            if figures is None:
                figures = self._minutes[minute] = Figures()
            figures.add_wait(seconds, outcome)
            self._dirty_minutes.add(minute)

    def size(self) -> int:
        """Entries held: minutes, days and canary keys' minutes."""
        with self._lock:
            return len(self._minutes) + len(self._days) + len(self._canary_keys)

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self._flushed_at >= FLUSH_SECONDS

    def flush(self, now: float | None = None) -> int:
        """Write every minute and day that changed since the last flush; returns rows written."""
        self._flushed_at = time.monotonic()
        wall = time.time() if now is None else now
        with self._lock:
            minutes = {key: self._minutes[key].copy() for key in self._dirty_minutes}
            days = {key: list(self._days[key]) for key in self._dirty_days}
            canary_keys = {key: list(self._canary_keys[key]) for key in self._dirty_canary_keys}
            self._dirty_minutes.clear()
            self._dirty_days.clear()
            self._dirty_canary_keys.clear()
        try:
            written = self._write(minutes, days) + self._write_canary_keys(canary_keys)
        except BaseException:
            # Written next time: the figures are absolute, so nothing is counted twice. Nothing
            # unwritten is let go below, however long the database stays away.
            with self._lock:
                self._dirty_minutes.update(minutes)
                self._dirty_days.update(days)
                self._dirty_canary_keys.update(canary_keys)
            raise
        with self._lock:
            # Requests land in the minute they end in: a minute two back is final here, and let
            # go once written.
            oldest = int(wall // MINUTE) * MINUTE - MINUTE
            for minute in [k for k in self._minutes if k[2] < oldest]:
                if minute not in self._dirty_minutes:
                    del self._minutes[minute]
            for by_key in [k for k in self._canary_keys if k[3] < oldest]:
                if by_key not in self._dirty_canary_keys:
                    del self._canary_keys[by_key]
            today = datetime.fromtimestamp(wall, UTC).date()
            for day in [k for k in self._days if k[2] < today - timedelta(days=1)]:
                if day not in self._dirty_days:
                    del self._days[day]
        return written

    def _write_canary_keys(self, canary_keys: dict[tuple[str, str, int, int], list[float]]) -> int:
        rows = [
            CanaryKeyMinute(
                model=model,
                revision=revision,
                key_id=key_id,
                start=datetime.fromtimestamp(start, UTC),
                writer=self.writer,
                requests=int(requests),
                server_errors=int(errors),
                seconds=seconds,
            )
            for (model, revision, key_id, start), (requests, errors, seconds) in canary_keys.items()
        ]
        if rows:
            CanaryKeyMinute.objects.bulk_create(
                rows,
                update_conflicts=True,
                unique_fields=["model", "revision", "key_id", "start", "writer"],
                update_fields=["requests", "server_errors", "seconds"],
            )
        return len(rows)

    def _write(
        self,
        minutes: dict[tuple[str, str, int], Figures],
        days: dict[tuple[int, str, date], list[int]],
    ) -> int:
        rows = [
            TrafficMinute(
                model=model,
                revision=revision,
                start=datetime.fromtimestamp(start, UTC),
                span=MINUTE,
                writer=self.writer,
                **figures.__dict__,
            )
            for (model, revision, start), figures in minutes.items()
        ]
        if rows:
            TrafficMinute.objects.bulk_create(
                rows,
                update_conflicts=True,
                unique_fields=["model", "revision", "start", "span", "writer"],
                update_fields=[*Figures().__dict__],
            )
        # A key deleted since (its owner was) has nothing left to count against.
        known = set(
            GatewayKey.objects.filter(pk__in={key_id for key_id, _, _ in days}).values_list(
                "pk", flat=True
            )
        )
        if len(known) < len({key_id for key_id, _, _ in days}):
            with self._lock:
                for day in [d for d in self._days if d[0] not in known and d in days]:
                    del self._days[day]
        usage = [
            KeyUsageDay(
                key_id=key_id,
                model=model,
                day=day,
                writer=self.writer,
                requests=requests,
                prompt_tokens=prompt,
                completion_tokens=completion,
            )
            for (key_id, model, day), (requests, prompt, completion) in days.items()
            if key_id in known
        ]
        if usage:
            KeyUsageDay.objects.bulk_create(
                usage,
                update_conflicts=True,
                unique_fields=["key", "model", "day", "writer"],
                update_fields=["requests", "prompt_tokens", "completion_tokens"],
            )
        return len(rows) + len(usage)


# -- folding (a beat task) ------------------------------------------------------------------


def fold(now: datetime | None = None) -> dict[str, int]:
    """Fold minutes older than a day into hours; delete what is older than it is kept for
    (figures after TRAFFIC_KEEP_DAYS, usage days after KEY_USAGE_KEEP_DAYS, canary keys' minutes
    after CANARY_KEYS_KEEP), so the tables stay bounded whatever the traffic. Run by beat."""
    now = now or datetime.now(UTC)
    cutoff = (now - timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
    with transaction.atomic():
        old = list(
            TrafficMinute.objects.select_for_update()
            .filter(span=MINUTE, start__lt=cutoff)
            .values("id", "model", "start", *Figures().__dict__)
        )
        hours: dict[tuple[str, datetime], Figures] = {}
        for row in old:
            hour = row["start"].replace(minute=0, second=0, microsecond=0)
            hours.setdefault((row["model"], hour), Figures()).add(row)
        existing = {
            (row.model, row.start): row
            for row in TrafficMinute.objects.select_for_update().filter(
                span=HOUR,
                writer="",
                start__in={h for _, h in hours},
                model__in={m for m, _ in hours},
            )
        }
        for (model, hour), figures in hours.items():
            row = existing.get((model, hour))
            if row is None:
                TrafficMinute.objects.create(
                    model=model, start=hour, span=HOUR, writer="", **figures.__dict__
                )
            else:
                figures.add({name: getattr(row, name) for name in Figures().__dict__})
                for name, value in figures.__dict__.items():
                    setattr(row, name, value)
                row.save()
        TrafficMinute.objects.filter(id__in=[row["id"] for row in old]).delete()
        expired = TrafficMinute.objects.filter(
            start__lt=now - timedelta(days=TRAFFIC_KEEP_DAYS)
        ).delete()[0]
        usage_expired = KeyUsageDay.objects.filter(
            day__lt=(now - timedelta(days=KEY_USAGE_KEEP_DAYS)).date()
        ).delete()[0]
        canary_expired = CanaryKeyMinute.objects.filter(start__lt=now - CANARY_KEYS_KEEP).delete()[
            0
        ]
    return {
        "folded": len(old),
        "hours": len(hours),
        "expired": expired + usage_expired + canary_expired,
    }


# -- reads --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    name: str
    length: timedelta
    step: timedelta


WINDOWS = {
    "hour": Window("hour", timedelta(hours=1), timedelta(minutes=1)),
    "day": Window("day", timedelta(days=1), timedelta(minutes=15)),
    "week": Window("week", timedelta(days=7), timedelta(hours=1)),
}


@dataclass(frozen=True)
class Point:
    start: datetime
    figures: Figures
    step: timedelta

    @property
    def tokens_per_second(self) -> float:
        return self.figures.completion_tokens / self.step.total_seconds()


def _floor(moment: datetime, step: timedelta) -> datetime:
    seconds = int(step.total_seconds())
    epoch = int(moment.timestamp())
    return datetime.fromtimestamp(epoch - epoch % seconds, UTC)


def series(
    models: Sequence[str], window: Window, *, now: datetime | None = None
) -> dict[str, list[Point]]:
    """Each model's figures in `window`, one point per step that had traffic; one query."""
    now = now or datetime.now(UTC)
    end = _floor(now, window.step) + window.step
    start = end - window.length
    rows = TrafficMinute.objects.filter(model__in=list(models), start__gte=start).values_list(
        "model", "start", *Figures().__dict__
    )
    names = list(Figures().__dict__)
    found: dict[str, dict[datetime, Figures]] = {name: {} for name in models}
    for model, row_start, *values in rows.iterator(chunk_size=2000):
        bucket = _floor(row_start, window.step)
        found[model].setdefault(bucket, Figures()).add(dict(zip(names, values, strict=True)))
    return {
        model: [Point(when, figures, window.step) for when, figures in sorted(points.items())]
        for model, points in found.items()
    }


def window_bounds(window: Window, now: datetime | None = None) -> tuple[datetime, datetime]:
    now = now or datetime.now(UTC)
    end = _floor(now, window.step) + window.step
    return end - window.length, end


def totals(points: Iterable[Point]) -> Figures:
    total = Figures()
    for point in points:
        total.add(point.figures)
    return total


def queue_totals(model: str, window: Window, *, now: datetime | None = None) -> Figures:
    """The fair queue's figures for `model` over `window` (the other figures left at 0); one
    query, which reads only the rows where a request queued or was refused as the queue was
    full, so it costs next to nothing while nobody queues. The sums are Figures.add's, as for
    series()."""
    start, _ = window_bounds(window, now)
    names = ["queued", "queue_seconds", "queue_seconds_max", "queue_timeouts", "queue_full"]
    rows = (
        TrafficMinute.objects.filter(model=model, start__gte=start)
        .filter(Q(queued__gt=0) | Q(queue_full__gt=0))
        .values_list(*names)
    )
    total = Figures()
    for values in rows.iterator(chunk_size=2000):
        total.add({**Figures().__dict__, **dict(zip(names, values, strict=True))})
    return total


@dataclass(frozen=True)
class ModelTraffic:
    """One model's figures over a window, as the API and `llmgw ctl model traffic` give them."""

    model: str
    window: Window
    start: datetime
    end: datetime
    points: list[Point]
    total: Figures
    waiting_now: int

    @property
    def step_seconds(self) -> int:
        return int(self.window.step.total_seconds())


def model_traffic(model: str, window: Window, *, now: datetime | None = None) -> ModelTraffic:
    """`model`'s figures over `window`, step by step and in total, with its requests waiting
    in the fair queue now; one query."""
    points = series([model], window, now=now)[model]
    start, end = window_bounds(window, now)
    return ModelTraffic(
        model=model,
        window=window,
        start=start,
        end=end,
        points=points,
        total=totals(points),
        waiting_now=live.waiting_now([model])[model],
    )


@functools.lru_cache(maxsize=4)
def _day_of(days: int) -> date:
    return datetime.fromtimestamp(days * 86400, UTC).date()


def _utc_date(at: float) -> date:
    """The UTC date of the moment `at` (a request's: the day is made once, not per request)."""
    return _day_of(int(at // 86400))
