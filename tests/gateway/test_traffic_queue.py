"""The fair queue's waits in the traffic figures: the book counts them, flush writes them, fold
adds them into hours, and the reads give them back (access.traffic)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from access import traffic
from access.models import TrafficMinute
from access.traffic import WINDOWS, TrafficBook
from gateway.asgi import Gateway
from gateway.fairqueue import FairQueue
from gateway.state import GatewayState

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 2, 12, 30, 20, tzinfo=UTC)
QUEUE_FIELDS = ("queued", "queue_seconds", "queue_seconds_max", "queue_timeouts", "queue_full")


def at(moment: datetime) -> float:
    return moment.timestamp()


def queue_of(row: TrafficMinute) -> tuple[int, float, float, int, int]:
    return (
        row.queued,
        round(row.queue_seconds, 6),
        round(row.queue_seconds_max, 6),
        row.queue_timeouts,
        row.queue_full,
    )


def test_it_counts_each_way_a_wait_ends() -> None:
    book = TrafficBook("w1")
    book.record_wait(model="m", seconds=0.5, outcome="served", at=at(NOW))
    book.record_wait(model="m", seconds=2.0, outcome="served", at=at(NOW))
    book.record_wait(model="m", seconds=60.0, outcome="timeout", at=at(NOW))
    book.record_wait(model="m", seconds=0.25, outcome="gone", at=at(NOW))
    book.record_wait(model="m", seconds=0.0, outcome="full", at=at(NOW))
    assert book.flush(now=at(NOW)) == 1
    row = TrafficMinute.objects.get()
    assert (row.model, row.revision, row.start) == ("m", "", NOW.replace(second=0))
    # Four waited (served, timed out, hung up); the one refused as full did not.
    assert queue_of(row) == (4, 62.75, 60.0, 1, 1)
    assert row.requests == 0  # the answers are counted where they end, by record()


def test_a_request_that_went_straight_through_is_not_counted() -> None:
    book = TrafficBook("w1")
    book.record_wait(model="m", seconds=0.0, outcome="served", at=at(NOW))
    assert book._minutes == {}
    assert book.flush(now=at(NOW)) == 0


def test_a_second_flush_writes_totals_and_the_longest_wait_so_far() -> None:
    book = TrafficBook("w1")
    book.record_wait(model="m", seconds=3.0, outcome="served", at=at(NOW))
    book.flush(now=at(NOW))
    book.record_wait(model="m", seconds=1.0, outcome="served", at=at(NOW))
    book.flush(now=at(NOW))
    book.flush(now=at(NOW))  # nothing new: nothing counted again
    assert queue_of(TrafficMinute.objects.get()) == (2, 4.0, 3.0, 0, 0)


def test_waits_and_answers_of_one_minute_read_as_one_point() -> None:
    book = TrafficBook("w1")
    book.record(model="m", key_id=None, status=200, seconds=1.2, at=at(NOW), revision="abc")
    book.record_wait(model="m", seconds=0.7, outcome="served", at=at(NOW))
    book.flush(now=at(NOW))
    # The answer in its revision's row, the wait in revision "": a chart adds them up.
    assert sorted(TrafficMinute.objects.values_list("revision", "requests", "queued")) == [
        ("", 0, 1),
        ("abc", 1, 0),
    ]
    points = traffic.series(["m"], WINDOWS["hour"], now=NOW)["m"]
    assert [(p.figures.requests, p.figures.queued) for p in points] == [(1, 1)]


def _minute(start: datetime, writer: str, queued: int, seconds: float, longest: float) -> None:
    TrafficMinute.objects.create(
        model="m",
        start=start,
        writer=writer,
        requests=queued,
        queued=queued,
        queue_seconds=seconds,
        queue_seconds_max=longest,
        queue_timeouts=1,
        queue_full=2,
    )


def _written_by_older_code(start: datetime, requests: int) -> None:
    """A row as a gateway process of before the queue's columns writes it (they are left out):
    the database's defaults make it read as nobody waiting."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TrafficMinute._meta.db_table} (model, revision, start, span, writer, "
            "requests, client_errors, server_errors, prompt_tokens, completion_tokens, seconds, "
            "latency_buckets) VALUES (%s, '', %s, 60, 'old', %s, 0, 0, 0, 0, 0, '[]')",
            ["m", start, requests],
        )


def test_fold_adds_the_waits_into_hours_and_keeps_the_longest() -> None:
    old_hour = (NOW - timedelta(days=2)).replace(minute=0, second=0)
    _minute(old_hour, "w1", 3, 6.0, 4.0)
    _minute(old_hour + timedelta(minutes=1), "w1", 2, 1.0, 0.75)
    _minute(old_hour + timedelta(minutes=7), "w2", 1, 9.5, 9.5)
    _written_by_older_code(old_hour + timedelta(minutes=9), requests=4)
    traffic.fold(now=NOW)
    hour = TrafficMinute.objects.get(span=3600)
    assert hour.requests == 10
    assert queue_of(hour) == (6, 16.5, 9.5, 3, 6)
    # A later fold into the same hour adds to it; the longest stays the longest.
    _minute(old_hour + timedelta(minutes=30), "w3", 1, 2.0, 2.0)
    traffic.fold(now=NOW)
    assert queue_of(TrafficMinute.objects.get(span=3600)) == (7, 18.5, 9.5, 4, 8)


def test_the_reads_give_the_mean_and_the_longest_wait_over_a_window() -> None:
    _minute(NOW.replace(second=0) - timedelta(minutes=5), "w1", 3, 6.0, 4.0)
    _minute(NOW.replace(second=0) - timedelta(minutes=5), "w2", 1, 2.0, 2.0)
    _minute(NOW.replace(second=0) - timedelta(minutes=50), "w1", 4, 2.0, 1.0)
    _minute(NOW - timedelta(hours=3), "w1", 10, 100.0, 50.0)  # outside the last hour
    TrafficMinute.objects.create(model="m", start=NOW.replace(second=0), requests=7)
    TrafficMinute.objects.create(model="other", start=NOW.replace(second=0), queued=9)

    found = traffic.model_traffic("m", WINDOWS["hour"], now=NOW)
    total = found.total
    assert (total.requests, total.queued, total.queue_timeouts, total.queue_full) == (15, 8, 3, 6)
    assert total.queue_seconds_mean == pytest.approx(10.0 / 8)
    assert total.queue_seconds_max == 4.0
    assert [p.figures.queued for p in found.points] == [4, 4, 0]
    assert found.waiting_now == 0 and found.step_seconds == 60

    # The model page's reader: the same sums, reading only rows where someone queued.
    with CaptureQueriesContext(connection) as queries:
        queue = traffic.queue_totals("m", WINDOWS["hour"], now=NOW)
    assert len(queries) == 1
    assert [getattr(queue, name) for name in QUEUE_FIELDS] == [
        getattr(total, name) for name in QUEUE_FIELDS
    ]
    day = traffic.queue_totals("m", WINDOWS["day"], now=NOW)
    assert (day.queued, day.queue_seconds_max) == (18, 50.0)
    assert traffic.queue_totals("nobody", WINDOWS["week"], now=NOW).queue_seconds_mean is None


def test_the_gateways_queue_hook_writes_into_the_book(monkeypatch: pytest.MonkeyPatch) -> None:
    book = TrafficBook("w1")
    queue = FairQueue(None)
    Gateway(state=GatewayState(book), queue=queue)  # which sets the queue's hooks
    queue._observe("m", 1.5, "served")
    queue._observe("m", 0.0, "served")
    queue._observe("m", 0.0, "full")
    book.flush()
    assert queue_of(TrafficMinute.objects.get(model="m")) == (1, 1.5, 1.5, 0, 1)
