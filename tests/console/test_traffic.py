"""Traffic on the console (charts, sparklines) and usage per key (page, API, CSV)."""

from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from access.models import GatewayKey, KeyUsageDay, TrafficMinute
from access.traffic import LATENCY_BOUNDS, TrafficBook
from tests.console.pages import text_of

pytestmark = pytest.mark.django_db


def _recent_minutes(model: str, minutes: list[int], requests: int = 3) -> list[datetime]:
    """Rows for `minutes` ago (each with `requests` requests and 2 completion tokens each)."""
    book = TrafficBook("test")
    now = datetime.now(UTC)
    starts = []
    for ago in minutes:
        moment = now - timedelta(minutes=ago)
        for _ in range(requests):
            book.record(
                model=model,
                key_id=None,
                status=200,
                seconds=0.2,
                completion=2,
                at=moment.timestamp(),
            )
        starts.append(moment.replace(second=0, microsecond=0))
    book.flush()
    return starts


def test_the_model_page_charts_the_minutes_with_traffic(client_for: Any, running: Any) -> None:
    starts = _recent_minutes("tiny-chat", [2, 5, 9])
    response = client_for("alice").get("/models/tiny-chat/")
    html = response.content.decode()
    assert 'id="model-traffic"' in html
    requests_chart = re.search(
        r'<svg class="chart"[^>]*data-chart="Requests per 1 min".*?</svg>', html
    )
    assert requests_chart is not None
    series = re.search(r'data-series="requests">(.*?)</g></g>', requests_chart.group(0) + "</g>")
    assert series is not None
    assert series.group(1).count('class="point"') == 3
    assert (
        re.findall(r'data-series="requests".*?data-value="([\d.]+)"', requests_chart.group(0))[0]
        == "3.0"
    )
    table_rows = re.findall(
        r'<tr data-minute="([^"]+)">.*?<td class="requests">(\d+)</td>', html, re.S
    )
    assert [int(n) for _, n in table_rows] == [3, 3, 3]
    assert [datetime.fromisoformat(m) for m, _ in table_rows] == sorted(starts)
    assert "9 requests" in text_of(response)


def test_another_window_comes_as_a_partial(client_for: Any, running: Any) -> None:
    _recent_minutes("tiny-chat", [3])
    response = client_for("alice").get(
        "/models/tiny-chat/traffic?window=week", HTTP_HX_REQUEST="true"
    )
    html = response.content.decode()
    assert html.lstrip().startswith('<section id="model-traffic"')
    assert 'data-window="week"' in html
    assert "Each point is 60 minutes" in html
    # An unknown window is the last hour, not an error.
    other = client_for("alice").get("/models/tiny-chat/traffic?window=<script>").content.decode()
    assert 'data-window="hour"' in other and "<script>" not in other


def test_the_model_page_costs_the_same_queries_with_a_week_of_figures(
    client_for: Any, running: Any
) -> None:
    client = client_for("alice")
    with CaptureQueriesContext(connection) as empty:
        client.get("/models/tiny-chat/")
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    TrafficMinute.objects.bulk_create(
        TrafficMinute(
            model="tiny-chat",
            start=now - timedelta(hours=h),
            span=3600,
            requests=5,
            latency_buckets=[5] + [0] * (len(LATENCY_BOUNDS) - 1),
        )
        for h in range(24, 24 * 7)
    )
    TrafficMinute.objects.bulk_create(
        TrafficMinute(model="tiny-chat", start=now - timedelta(minutes=m), writer=w, requests=1)
        for m in range(24 * 60)
        for w in ("a", "b")
    )
    for window in ("hour", "day", "week"):
        with CaptureQueriesContext(connection) as full:
            client.get(f"/models/tiny-chat/traffic?window={window}")
        with CaptureQueriesContext(connection) as page:
            client.get("/models/tiny-chat/")
        assert len(page) == len(empty), window
        assert len(full) <= len(empty)


def test_the_models_list_has_a_sparkline_per_model(client_for: Any, running: Any) -> None:
    _recent_minutes("tiny-chat", [1, 4, 7, 20])
    html = client_for("alice").get("/").content.decode()
    row = re.search(r'<tr id="model-tiny-chat".*?</tr>', html, re.S)
    assert row is not None
    assert 'data-points="4"' in row.group(0)
    assert "tiny-chat: requests per minute: 12 in the last hour" in row.group(0)
    other = re.search(r'<tr id="model-other-chat".*?</tr>', html, re.S)
    assert other is not None and 'data-points="0"' in other.group(0)


# -- usage -----------------------------------------------------------------------------------


@pytest.fixture
def usage(users: dict[str, Any]) -> dict[str, GatewayKey]:
    keys = {
        "alice": GatewayKey.objects.create(
            name="alice app", owner=users["alice"], prefix="llmgw-aa", key_hash="a" * 64
        ),
        "bob": GatewayKey.objects.create(
            name="bob app", owner=users["bob"], prefix="llmgw-bb", key_hash="b" * 64
        ),
    }
    today = datetime.now(UTC).date()
    for name, key in keys.items():
        for writer in ("w1", "w2"):
            KeyUsageDay.objects.create(
                key=key,
                model="tiny-chat",
                day=today,
                writer=writer,
                requests=2,
                prompt_tokens=10,
                completion_tokens=4 if name == "alice" else 40,
            )
        KeyUsageDay.objects.create(
            key=key, model="tiny-chat", day=today - timedelta(days=40), requests=100
        )
    return keys


def test_a_user_sees_the_usage_of_their_own_keys(client_for: Any, usage: Any) -> None:
    response = client_for("alice").get("/usage/")
    html = response.content.decode()
    text = text_of(response)
    assert "alice app" in text and "bob app" not in text
    assert re.search(r'<th class="requests">4</th>.*?<th class="completion">8</th>', html, re.S)


def test_staff_see_everyones_usage(client_for: Any, usage: Any) -> None:
    text = text_of(client_for("staff").get("/usage/"))
    assert "alice app" in text and "bob app" in text


def test_the_usage_filters_say_what_is_wrong(client_for: Any, usage: Any) -> None:
    text = text_of(client_for("alice").get("/usage/?since=yesterday&key=x"))
    assert "'yesterday' is not a day; write it as YYYY-MM-DD." in text
    assert "'x' is not a key id" in text


def test_usage_downloads_as_csv(api: Any, usage: Any) -> None:
    response = api("alice").get("/api/v1/usage?format=csv&since=2000-01-01")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["key_name"], r["requests"]) for r in rows] == [
        ("alice app", "4"),
        ("alice app", "100"),
    ]


def test_the_usage_api_refuses_bad_filters(api: Any, usage: Any) -> None:
    response = api("alice").get("/api/v1/usage?since=31/12/2026")
    assert response.status_code == 400
    assert "since" in response.content.decode()
    assert api("alice").get("/api/v1/usage?key=0").status_code == 400


# -- capacity ----------------------------------------------------------------------------------


def test_the_nodes_page_charts_reserved_against_capacity(client_for: Any, running: Any) -> None:
    from fleet import capacity
    from fleet.models import CapacitySample

    now = datetime.now(UTC)
    for ago in (30, 20, 10):
        capacity.sample(now - timedelta(minutes=ago))
    assert CapacitySample.objects.count() == 3  # node-a, three minutes
    html = client_for("alice").get("/nodes/").content.decode()
    chart = re.search(
        r'<svg class="chart"[^>]*data-chart="Memory reserved of capacity, GB".*?</svg>', html
    )
    assert chart is not None
    reserved = re.search(r'data-series="reserved">(.*?)</g></g>', chart.group(0) + "</g>")
    assert reserved is not None and reserved.group(1).count('class="point"') == 3


def test_capacity_samples_are_thinned_and_expired(running: Any) -> None:
    from fleet import capacity
    from fleet.models import CapacitySample

    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    for minutes in reversed(range(60 * 26)):  # oldest first, as beat samples
        capacity.sample(now - timedelta(minutes=minutes))
    old = CapacitySample.objects.filter(start__lt=now - timedelta(days=1))
    assert old.exists() and all(s.start.minute % 10 == 0 for s in old)
    capacity.sample(now + timedelta(days=9))
    assert not CapacitySample.objects.filter(start__lt=now).exists()


def test_the_model_page_names_the_slowest_request_to_follow(client_for: Any, running: Any) -> None:
    now = datetime.now(UTC)
    recent = (now - timedelta(minutes=3)).timestamp()
    older = (now - timedelta(minutes=8)).timestamp()
    first, second = TrafficBook("w1"), TrafficBook("w2")
    for book, seconds, moment, request_id in (
        (first, 0.2, recent, "fast-a"),
        (first, 2.31, recent, "slow-a"),
        (second, 1.0, recent, "other-writer"),
        (first, 0.5, older, "mid-b"),
    ):
        book.record(
            model="tiny-chat",
            key_id=None,
            status=200,
            seconds=seconds,
            at=moment,
            request_id=request_id,
        )
    first.flush()
    second.flush()
    response = client_for("alice").get("/models/tiny-chat/")
    html = response.content.decode()
    text = re.sub(r" ([,.])", r"\1", text_of(response))
    assert (
        "Slowest request in the last hour: 2.31 s, ID slow-a. To follow a request: its log lines, "
        "grep the ID in var/log/; its trace, search llmgw.request_id in your tracing backend."
    ) in text
    assert 'data-slowest-request="slow-a"' in html
    # Each row of the numbers names its slowest request, over both writers, oldest first.
    cells = re.findall(r'<td class="slowest">(.*?)</td>', html, re.S)
    assert [re.sub(r"<[^>]+>", "", cell) for cell in cells] == ["0.50 s mid-b", "2.31 s slow-a"]


def test_no_slowest_request_without_answers(client_for: Any, running: Any) -> None:
    _recent_minutes("other-chat", [2])
    assert "Slowest request" not in client_for("alice").get("/models/tiny-chat/").content.decode()
