"""A model's traffic under /api/v1/models/NAME/traffic (access.usage_api.ModelTrafficAPI): the
gateway's figures over a window, the fair queue's among them, and the requests waiting now."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from access.models import TrafficMinute
from access.traffic import LATENCY_BOUNDS, TrafficBook
from tests.factories import definition
from tests.gateway.waiting import requests_waiting

pytestmark = pytest.mark.django_db

FIGURES = {
    "requests",
    "client_errors",
    "server_errors",
    "latency_p50_seconds",
    "latency_p95_seconds",
    "prompt_tokens",
    "completion_tokens",
    "queued",
    "queue_seconds_mean",
    "queue_seconds_max",
    "queue_timeouts",
    "queue_full",
    "slowest_seconds",
    "slowest_request",
}


@pytest.fixture
def chat(users: dict[str, Any]) -> str:
    from catalog.definitions import clean_definition
    from catalog.services import model_add
    from core.actor import Actor

    model_add(
        actor=Actor.for_user(users["alice"], "api"),
        definition=clean_definition(definition("chat")),
        source_check=False,
    )
    return "chat"


def _traffic(minutes_ago: int, *waits: tuple[float, str], requests: int = 2) -> None:
    """`requests` answers of 0.3 s and the given waits, `minutes_ago`, written by a book."""
    book = TrafficBook(f"w{minutes_ago}")
    moment = (datetime.now(UTC) - timedelta(minutes=minutes_ago)).timestamp()
    for _ in range(requests):
        book.record(model="chat", key_id=None, status=200, seconds=0.3, completion=4, at=moment)
    for seconds, outcome in waits:
        book.record_wait(model="chat", seconds=seconds, outcome=outcome, at=moment)
    book.flush(now=moment)


def test_it_gives_the_figures_of_the_window_with_the_queues(chat: str, api: Any) -> None:
    _traffic(3, (1.5, "served"), (0.5, "served"), (0.0, "full"))
    _traffic(20, (30.0, "timeout"))
    _traffic(60 * 5, (99.0, "served"))  # outside the last hour
    answer = api("bob").get("/api/v1/models/chat/traffic")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert set(body) == {
        "model",
        "window",
        "start",
        "end",
        "step_seconds",
        "waiting_now",
        "total",
        "points",
    }
    assert (body["model"], body["window"], body["step_seconds"]) == ("chat", "hour", 60)
    assert body["waiting_now"] == 0
    total = body["total"]
    assert set(total) == FIGURES
    assert (total["requests"], total["client_errors"], total["completion_tokens"]) == (4, 0, 16)
    assert 0.25 < total["latency_p50_seconds"] <= 0.5
    assert (total["queued"], total["queue_timeouts"], total["queue_full"]) == (3, 1, 1)
    assert total["queue_seconds_mean"] == pytest.approx(32.0 / 3)
    assert total["queue_seconds_max"] == 30.0
    points = body["points"]
    assert [p["queued"] for p in points] == [1, 2]  # oldest first
    assert set(points[0]) == FIGURES | {"start", "tokens_per_second"}
    assert points[1]["queue_seconds_mean"] == pytest.approx(1.0)
    assert points[1]["queue_seconds_max"] == 1.5
    assert points[1]["tokens_per_second"] == pytest.approx(8 / 60)

    week = api("alice").get("/api/v1/models/chat/traffic?window=week").json()
    assert (week["window"], week["step_seconds"]) == ("week", 3600)
    assert (week["total"]["queued"], week["total"]["queue_seconds_max"]) == (4, 99.0)


def test_a_model_without_traffic_has_empty_figures(chat: str, api: Any) -> None:
    body = api("alice").get("/api/v1/models/chat/traffic?window=day").json()
    assert body["points"] == []
    assert body["total"]["queued"] == 0
    assert body["total"]["queue_seconds_mean"] is None
    assert body["total"]["queue_seconds_max"] == 0
    assert (body["total"]["slowest_seconds"], body["total"]["slowest_request"]) == (0, "")
    assert body["total"]["latency_p50_seconds"] is None


def test_it_counts_the_requests_waiting_now_on_this_machine(
    chat: str, api: Any, settings: Any, tmp_path: Any
) -> None:
    settings.VAR_DIR = tmp_path
    with requests_waiting(tmp_path / "gateway-queue", "chat", 2):
        assert api("alice").get("/api/v1/models/chat/traffic").json()["waiting_now"] == 2
    assert api("alice").get("/api/v1/models/chat/traffic").json()["waiting_now"] == 0


def test_its_refusals(chat: str, api: Any, client: Any) -> None:
    wrong = api("alice").get("/api/v1/models/chat/traffic?window=month")
    assert wrong.status_code == 400
    assert wrong.json()["problems"] == [
        {
            "field": "window",
            "message": "'month' is not a window: use hour, day or week (the default, hour, when "
            "left out)",
        }
    ]
    unknown = api("alice").get("/api/v1/models/chatt/traffic")
    assert unknown.status_code == 404
    assert unknown.json()["code"] == "not_found"
    assert "chat" in unknown.json()["detail"]  # the closest names
    assert client.get("/api/v1/models/chat/traffic").status_code == 401


def test_minutes_where_nobody_queued_have_no_mean_wait(chat: str, api: Any) -> None:
    TrafficMinute.objects.create(
        model="chat",
        start=datetime.now(UTC).replace(second=0, microsecond=0),
        requests=3,
        latency_buckets=[3] + [0] * (len(LATENCY_BOUNDS) - 1),
    )
    total = api("alice").get("/api/v1/models/chat/traffic").json()["total"]
    assert (total["requests"], total["queued"], total["queue_seconds_mean"]) == (3, 0, None)


def test_it_names_the_slowest_request_of_each_point_and_of_the_window(chat: str, api: Any) -> None:
    now = datetime.now(UTC)
    for writer, minutes_ago, answers in (
        ("w1", 12, [(0.4, "early-fast"), (1.25, "early-slow")]),
        ("w1", 2, [(0.3, "late-fast"), (2.31, "late-slow")]),
        ("w2", 2, [(0.9, "other-writer")]),
        ("w3", 60 * 5, [(40.0, "hours-ago")]),  # outside the last hour
    ):
        book = TrafficBook(writer)
        moment = (now - timedelta(minutes=minutes_ago)).timestamp()
        for seconds, request_id in answers:
            book.record(
                model="chat",
                key_id=None,
                status=200,
                seconds=seconds,
                at=moment,
                request_id=request_id,
            )
        book.flush(now=moment)
    body = api("bob").get("/api/v1/models/chat/traffic").json()
    assert [(p["slowest_seconds"], p["slowest_request"]) for p in body["points"]] == [
        (1.25, "early-slow"),
        (2.31, "late-slow"),
    ]
    assert (body["total"]["slowest_seconds"], body["total"]["slowest_request"]) == (
        2.31,
        "late-slow",
    )
    week = api("bob").get("/api/v1/models/chat/traffic?window=week").json()
    assert (week["total"]["slowest_seconds"], week["total"]["slowest_request"]) == (
        40.0,
        "hours-ago",
    )
