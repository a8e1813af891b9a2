"""Traffic over time: the per-process book, its writes, folding minutes into hours, and reads."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.test.utils import CaptureQueriesContext

from access import traffic
from access.models import GatewayKey, KeyUsageDay, TrafficMinute
from access.traffic import LATENCY_BOUNDS, WINDOWS, Figures, TrafficBook

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 2, 12, 30, 20, tzinfo=UTC)


def at(moment: datetime) -> float:
    return moment.timestamp()


@pytest.fixture
def key(django_user_model: type) -> GatewayKey:
    owner = django_user_model.objects.create_user("alice")
    return GatewayKey.objects.create(name="app", owner=owner, prefix="llmgw-ab", key_hash="x" * 64)


def test_it_writes_a_minute_with_its_figures(key: GatewayKey) -> None:
    book = TrafficBook("w1")
    book.record(
        model="m", key_id=key.id, status=200, seconds=0.2, prompt=5, completion=7, at=at(NOW)
    )
    book.record(model="m", key_id=key.id, status=503, seconds=0.001, at=at(NOW))
    book.record(model="m", key_id=None, status=404, seconds=0.001, at=at(NOW))
    assert book.flush(now=at(NOW)) == 2
    row = TrafficMinute.objects.get()
    assert row.start == NOW.replace(second=0)
    assert (row.requests, row.client_errors, row.server_errors) == (3, 1, 1)
    assert (row.prompt_tokens, row.completion_tokens) == (5, 7)
    assert sum(row.latency_buckets) == 3
    usage = KeyUsageDay.objects.get()
    assert (usage.key_id, usage.model, usage.day) == (key.id, "m", NOW.date())
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (2, 5, 7)


def test_a_second_flush_writes_totals_not_increments(key: GatewayKey) -> None:
    book = TrafficBook("w1")
    book.record(model="m", key_id=key.id, status=200, seconds=0.1, completion=3, at=at(NOW))
    book.flush(now=at(NOW))
    book.flush(now=at(NOW))  # nothing new: nothing counted again
    book.record(model="m", key_id=key.id, status=200, seconds=0.1, completion=4, at=at(NOW))
    book.flush(now=at(NOW))
    row = TrafficMinute.objects.get()
    assert (row.requests, row.completion_tokens) == (2, 7)
    assert KeyUsageDay.objects.get().requests == 2


def test_writers_keep_their_own_rows_and_reads_add_them_up(key: GatewayKey) -> None:
    for writer, count in (("w1", 2), ("w2", 3)):
        book = TrafficBook(writer)
        for _ in range(count):
            book.record(model="m", key_id=key.id, status=200, seconds=0.05, at=at(NOW))
        book.flush(now=at(NOW))
    assert TrafficMinute.objects.count() == 2
    points = traffic.series(["m"], WINDOWS["hour"], now=NOW)["m"]
    assert [p.figures.requests for p in points] == [5]


def test_a_failed_write_is_written_next_time(
    key: GatewayKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    book = TrafficBook("w1")
    book.record(model="m", key_id=key.id, status=200, seconds=0.1, at=at(NOW))

    def broken(*args: object, **kwargs: object) -> int:
        raise RuntimeError("database away")

    monkeypatch.setattr(book, "_write", broken)
    with pytest.raises(RuntimeError):
        book.flush(now=at(NOW))
    monkeypatch.undo()
    assert book.flush(now=at(NOW)) == 2
    assert TrafficMinute.objects.get().requests == 1


def test_the_book_forgets_minutes_once_they_are_written_and_over() -> None:
    book = TrafficBook("w1")
    book.record(model="m", key_id=None, status=200, seconds=0.1, at=at(NOW))
    book.flush(now=at(NOW + timedelta(minutes=5)))
    assert book._minutes == {}
    assert TrafficMinute.objects.get().requests == 1  # written before it was let go


def test_figures_the_database_could_not_take_wait_for_it_however_long(
    monkeypatch: pytest.MonkeyPatch, key: GatewayKey
) -> None:
    """A database away for ten minutes: the minutes and days it missed are still held when it is
    back, and written once."""
    book = TrafficBook("w1")
    book.record(model="m", key_id=key.pk, status=200, seconds=0.1, prompt=3, at=at(NOW))
    written = book._write

    def away(*_: Any) -> int:
        raise OperationalError("the database is away")

    monkeypatch.setattr(book, "_write", away)
    for minutes in (1, 5, 10):
        with pytest.raises(OperationalError):
            book.flush(now=at(NOW + timedelta(minutes=minutes)))
    monkeypatch.setattr(book, "_write", written)
    assert book.flush(now=at(NOW + timedelta(minutes=11))) == 2
    assert TrafficMinute.objects.get().requests == 1
    assert book._minutes == {}  # let go once written
    assert book.flush(now=at(NOW + timedelta(minutes=12))) == 0  # nothing written twice


def test_latency_quantiles_interpolate_within_a_bucket() -> None:
    figures = Figures()
    for _ in range(100):
        figures.add_request(200, 0.3, 0, 0)  # bucket (0.25, 0.5]
    p50 = figures.latency(0.5)
    assert p50 is not None and 0.25 < p50 <= 0.5
    assert Figures().latency(0.5) is None
    slow = Figures()
    slow.add_request(200, 10_000, 0, 0)
    assert slow.latency(0.95) == LATENCY_BOUNDS[-2]
    assert math.isinf(LATENCY_BOUNDS[-1])


def _minutes(model: str, start: datetime, count: int, writer: str = "w1") -> None:
    TrafficMinute.objects.bulk_create(
        TrafficMinute(
            model=model,
            start=start + timedelta(minutes=i),
            writer=writer,
            requests=2,
            server_errors=1,
            completion_tokens=10,
            seconds=1.0,
            latency_buckets=[0, 0, 0, 0, 2] + [0] * (len(LATENCY_BOUNDS) - 5),
        )
        for i in range(count)
    )


def test_fold_turns_minutes_older_than_a_day_into_hours() -> None:
    old_hour = (NOW - timedelta(days=2)).replace(minute=0, second=0)
    _minutes("m", old_hour, 60, "w1")
    _minutes("m", old_hour, 30, "w2")
    _minutes("m", NOW.replace(second=0) - timedelta(minutes=10), 5)  # recent: stays
    result = traffic.fold(now=NOW)
    assert result["folded"] == 90
    hour = TrafficMinute.objects.get(span=3600)
    assert (hour.start, hour.writer, hour.requests) == (old_hour, "", 180)
    assert (hour.server_errors, hour.completion_tokens) == (90, 900)
    assert sum(hour.latency_buckets) == 180
    assert TrafficMinute.objects.filter(span=60).count() == 5
    # Folding again changes nothing.
    traffic.fold(now=NOW)
    assert TrafficMinute.objects.get(span=3600).requests == 180


def test_fold_deletes_what_is_older_than_it_is_kept_for(key: GatewayKey) -> None:
    TrafficMinute.objects.create(
        model="m", start=NOW - timedelta(days=9), span=3600, writer="", requests=1
    )
    KeyUsageDay.objects.create(key=key, model="m", day=(NOW - timedelta(days=500)).date())
    KeyUsageDay.objects.create(key=key, model="m", day=NOW.date())
    traffic.fold(now=NOW)
    assert not TrafficMinute.objects.exists()
    assert KeyUsageDay.objects.count() == 1


def test_a_week_of_figures_is_read_in_one_query() -> None:
    week_start, _ = traffic.window_bounds(WINDOWS["week"], now=NOW)
    before = week_start - timedelta(hours=1)  # outside the window: not read
    TrafficMinute.objects.create(model="m", start=before, span=3600, requests=1000)
    week_ago = week_start
    TrafficMinute.objects.bulk_create(
        TrafficMinute(model="m", start=week_ago + timedelta(hours=h), span=3600, requests=1)
        for h in range(24 * 6)
    )
    _minutes("m", NOW.replace(second=0) - timedelta(hours=23), 23 * 60)
    for name, window in WINDOWS.items():
        with CaptureQueriesContext(connection) as queries:
            points = traffic.series(["m", "other"], window, now=NOW)
        assert len(queries) == 1, name
        assert points["other"] == []
    week = traffic.series(["m"], WINDOWS["week"], now=NOW)["m"]
    assert sum(p.figures.requests for p in week) == 24 * 6 + 23 * 60 * 2
    hour = traffic.series(["m"], WINDOWS["hour"], now=NOW)["m"]
    assert len(hour) == 59  # 11:31 to 12:29: the window ends with the minute now in
    assert hour[-1].tokens_per_second == pytest.approx(10 / 60)


def test_usage_of_a_key_deleted_since_is_dropped_and_the_rest_written(key: GatewayKey) -> None:
    book = TrafficBook("w1")
    book.record(model="m", key_id=key.id, status=200, seconds=0.1, at=at(NOW))
    gone = GatewayKey.objects.create(
        name="gone", owner=key.owner, prefix="llmgw-cd", key_hash="y" * 64
    )
    book.record(model="m", key_id=gone.id, status=200, seconds=0.1, at=at(NOW))
    gone.delete()
    assert book.flush(now=at(NOW)) == 2  # the minute and the remaining key's day
    assert TrafficMinute.objects.get().requests == 2
    assert [u.key_id for u in KeyUsageDay.objects.all()] == [key.id]
    assert book.flush(now=at(NOW)) == 0


def test_the_book_stays_flat_over_ten_times_the_time_it_keeps(key: GatewayKey) -> None:
    """Thirty minutes and twenty days of traffic, flushed as the gateway does: the book holds two
    minutes and two days at most (its bound is time), and its memory does not grow."""
    import tracemalloc

    book = TrafficBook("w1")
    models = [f"m{i}" for i in range(5)]

    def a_minute(start: datetime) -> None:
        for second in range(0, 60, 6):
            for model in models:
                moment = at(start + timedelta(seconds=second))
                book.record(model=model, key_id=key.pk, status=200, seconds=0.1, at=moment)
        book.flush(now=at(start + timedelta(seconds=59)))

    # Its bound reached first (three minutes, three days), then ten times as long again.
    for minute in range(3):
        a_minute(NOW + timedelta(minutes=minute))
    for day in range(1, 4):
        a_minute(NOW + timedelta(days=day))
    largest = 0
    tracemalloc.start()
    try:
        for minute in range(30):
            a_minute(NOW + timedelta(days=4, minutes=minute))
            largest = max(largest, book.size())
        for day in range(5, 15):
            a_minute(NOW + timedelta(days=day))
            largest = max(largest, book.size())
        middle = tracemalloc.take_snapshot()
        for day in range(15, 25):
            a_minute(NOW + timedelta(days=day))
            largest = max(largest, book.size())
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # At most: 2 minutes x 5 models, and 2 days x 5 models for the one key.
    assert largest <= 2 * len(models) + 2 * len(models), largest
    # What the book's code holds does not grow over the last ten days (fifty entries a day would
    # be some 40 KB).
    grown = [
        stat
        for stat in after.compare_to(middle, "lineno")
        if stat.traceback[0].filename == traffic.__file__
    ]
    assert sum(stat.size_diff for stat in grown) < 8 * 1024, [str(stat) for stat in grown[:5]]
