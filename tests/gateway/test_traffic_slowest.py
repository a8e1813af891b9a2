"""The slowest answer of each traffic row, with its request's ID: the book keeps it per minute,
flush writes it, the reads and fold keep the slowest of several rows (access.traffic), and the
gateway gives the book the ID its client sent (X-Request-ID)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from access import traffic
from access.models import TrafficMinute
from access.traffic import WINDOWS, Figures, TrafficBook
from tests.gateway.fake_engine import FakeEngine
from tests.support.waiting import wait_for

NOW = datetime(2026, 12, 2, 12, 30, 20, tzinfo=UTC)
MINUTE = NOW.replace(second=0)


def at(moment: datetime) -> float:
    return moment.timestamp()


def slowest(row: Figures | TrafficMinute) -> tuple[float, str]:
    return (round(row.slowest_seconds, 6), row.slowest_request)


def answer(book: TrafficBook, seconds: float, request_id: str, moment: datetime = NOW) -> None:
    book.record(
        model="m", key_id=None, status=200, seconds=seconds, at=at(moment), request_id=request_id
    )


def test_figures_keep_the_slowest_answer_and_its_id() -> None:
    figures = Figures()
    assert slowest(figures) == (0.0, "")
    figures.add_request(200, 0.5, 1, 1, "a")
    figures.add_request(500, 2.0, 1, 1, "b")
    figures.add_request(200, 1.0, 1, 1, "c")
    figures.add_request(200, 2.0, 1, 1, "d")  # as slow, not slower: the first stays
    assert slowest(figures) == (2.0, "b")
    # Without an ID (a caller of before), the slowest is still kept.
    figures.add_request(200, 3.0, 0, 0)
    assert slowest(figures) == (3.0, "")
    merged = Figures()
    merged.add(figures)
    merged.add({**Figures().__dict__, "slowest_seconds": 1.5, "slowest_request": "e"})
    assert slowest(merged) == (3.0, "")
    assert slowest(merged.copy()) == (3.0, "")


@pytest.mark.django_db
def test_the_book_keeps_the_slowest_request_of_each_minute() -> None:
    book = TrafficBook("w1")
    answer(book, 0.2, "fast")
    answer(book, 4.5, "slow-one")
    answer(book, 1.0, "middle")
    answer(book, 9.0, "next-minute", NOW + timedelta(minutes=1))
    assert book.flush(now=at(NOW)) == 2
    rows = TrafficMinute.objects.order_by("start")
    assert [(row.requests, *slowest(row)) for row in rows] == [
        (3, 4.5, "slow-one"),
        (1, 9.0, "next-minute"),
    ]
    # Later answers of the minute: a faster one changes nothing, a slower one takes its place.
    answer(book, 3.0, "faster")
    book.flush(now=at(NOW))
    assert slowest(TrafficMinute.objects.get(start=MINUTE)) == (4.5, "slow-one")
    answer(book, 6.25, "slower")
    book.flush(now=at(NOW))
    book.flush(now=at(NOW))  # nothing new: nothing changed
    assert slowest(TrafficMinute.objects.get(start=MINUTE)) == (6.25, "slower")


@pytest.mark.django_db
def test_the_reads_give_the_slowest_over_writers_and_steps() -> None:
    first, second = TrafficBook("w1"), TrafficBook("w2")
    answer(first, 2.0, "first-slowest")
    answer(first, 0.1, "first-fast")
    answer(second, 7.5, "second-slowest")
    answer(first, 3.0, "earlier", NOW - timedelta(minutes=20))
    answer(first, 99.0, "hours-ago", NOW - timedelta(hours=3))  # outside the last hour
    first.flush(now=at(NOW))
    second.flush(now=at(NOW))

    found = traffic.model_traffic("m", WINDOWS["hour"], now=NOW)
    assert [slowest(p.figures) for p in found.points] == [
        (3.0, "earlier"),
        (7.5, "second-slowest"),  # of both writers' rows of the minute
    ]
    assert slowest(found.total) == (7.5, "second-slowest")
    assert slowest(traffic.model_traffic("m", WINDOWS["day"], now=NOW).total) == (
        99.0,
        "hours-ago",
    )
    # The fair queue's own reader leaves them be.
    assert slowest(traffic.queue_totals("m", WINDOWS["hour"], now=NOW)) == (0.0, "")


def _minute(start: datetime, writer: str, seconds: float, request_id: str) -> None:
    TrafficMinute.objects.create(
        model="m",
        start=start,
        writer=writer,
        requests=1,
        slowest_seconds=seconds,
        slowest_request=request_id,
    )


@pytest.mark.django_db
def test_fold_keeps_the_slowest_of_the_hour() -> None:
    old_hour = (NOW - timedelta(days=2)).replace(minute=0, second=0)
    _minute(old_hour, "w1", 1.0, "a")
    _minute(old_hour + timedelta(minutes=4), "w2", 12.0, "slowest-of-the-hour")
    _minute(old_hour + timedelta(minutes=59), "w1", 3.0, "c")
    _minute(old_hour + timedelta(hours=1), "w1", 2.0, "next-hour")
    # A row written by a gateway process of before these columns reads as none known.
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TrafficMinute._meta.db_table} (model, revision, start, span, writer, "
            "requests, client_errors, server_errors, prompt_tokens, completion_tokens, seconds, "
            "latency_buckets) VALUES ('m', '', %s, 60, 'old', 5, 0, 0, 0, 0, 0, '[]')",
            [old_hour + timedelta(minutes=9)],
        )
    assert slowest(TrafficMinute.objects.get(writer="old")) == (0.0, "")

    traffic.fold(now=NOW)
    hours = TrafficMinute.objects.filter(span=3600).order_by("start")
    assert [(h.requests, *slowest(h)) for h in hours] == [
        (8, 12.0, "slowest-of-the-hour"),
        (1, 2.0, "next-hour"),
    ]
    # A later fold into the same hour: a faster minute leaves the slowest, a slower one takes it.
    _minute(old_hour + timedelta(minutes=30), "w3", 5.0, "faster")
    traffic.fold(now=NOW)
    assert slowest(TrafficMinute.objects.get(span=3600, start=old_hour)) == (
        12.0,
        "slowest-of-the-hour",
    )
    _minute(old_hour + timedelta(minutes=31), "w3", 20.0, "slower")
    traffic.fold(now=NOW)
    assert slowest(TrafficMinute.objects.get(span=3600, start=old_hour)) == (20.0, "slower")


# -- through the gateway ----------------------------------------------------------------------


@pytest.fixture
def book(monkeypatch: pytest.MonkeyPatch) -> TrafficBook:
    from tests.support.gateway_state import current_state

    fresh = TrafficBook("test")
    monkeypatch.setattr(current_state(), "book", fresh)  # the gateway's (gateway.app.Gateway.book)
    return fresh


def test_a_slow_requests_id_is_its_minutes_slowest_request(
    gw: Any, catalog: Any, engine: FakeEngine, book: TrafficBook
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    body = {"model": "chat", "prompt": "a"}
    fast = gw.request("POST", "/v1/completions", json=body, headers={"X-Request-ID": "fast-1"})
    assert fast.status_code == 200
    # A stream whose engine waits between its events: the slow one.
    engine.events, engine.delay = 4, 0.15
    slow = gw.request(
        "POST",
        "/v1/completions",
        json={**body, "stream": True},
        headers={"X-Request-ID": "slow-req-42"},
        stream=True,
    )
    assert slow.headers["X-Request-ID"] == "slow-req-42"
    assert b"[DONE]" in slow.content
    engine.delay = 0.0
    fast = gw.request("POST", "/v1/completions", json=body, headers={"X-Request-ID": "fast-2"})
    assert fast.status_code == 200

    # The stream is counted once its end is sent: wait for its count to reach the database.
    def written() -> list[TrafficMinute]:
        book.flush()
        rows = list(TrafficMinute.objects.filter(model="chat"))
        return rows if sum(row.requests for row in rows) >= 3 else []

    rows = wait_for(written, timeout=10, what="the three requests counted in the database")
    assert sum(row.requests for row in rows) == 3
    row = max(rows, key=lambda r: r.slowest_seconds)  # one row, unless a minute ended between
    assert row.slowest_request == "slow-req-42"
    assert row.slowest_seconds >= 0.45
    total = traffic.model_traffic("chat", WINDOWS["hour"]).total
    assert slowest(total) == slowest(row)
