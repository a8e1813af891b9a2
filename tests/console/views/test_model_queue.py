"""The fair queue on a model's page, beside its traffic: the requests waiting for a free slot now
(this machine's gateway processes), and those that waited over the charts' window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from access.traffic import TrafficBook
from tests.console.pages import HTMX, text_of
from tests.gateway.waiting import requests_waiting

pytestmark = pytest.mark.django_db


def _waits(minutes_ago: int, *waits: tuple[float, str]) -> None:
    book = TrafficBook(f"w{minutes_ago}")
    moment = (datetime.now(UTC) - timedelta(minutes=minutes_ago)).timestamp()
    book.record(model="tiny-chat", key_id=None, status=200, seconds=0.2, at=moment)
    for seconds, outcome in waits:
        book.record_wait(model="tiny-chat", seconds=seconds, outcome=outcome, at=moment)
    book.flush(now=moment)


def test_the_page_shows_the_requests_waiting_now(
    client_for: Any, running: Any, settings: Any, tmp_path: Any
) -> None:
    settings.VAR_DIR = tmp_path
    client = client_for("carol")
    with requests_waiting(tmp_path / "gateway-queue", "tiny-chat", 3):
        response = client.get("/models/tiny-chat/")
        assert 'data-waiting="3"' in response.content.decode()
        assert "Waiting for a free slot now: 3 (requests the gateway holds" in text_of(response)
        # Another model's waiters are its own.
        assert 'data-waiting="0"' in client.get("/models/other-chat/").content.decode()
    assert "Waiting for a free slot now: 0" in text_of(client.get("/models/tiny-chat/"))


def test_the_page_shows_the_waits_of_the_charts_window(client_for: Any, running: Any) -> None:
    _waits(5, (0.4, "served"), (1.1, "served"), (60.0, "timeout"), (0.0, "full"))
    _waits(30, (2.5, "served"))
    _waits(60 * 20, (90.0, "served"))  # in the last day, not the last hour
    text = text_of(client_for("carol").get("/models/tiny-chat/"))
    assert (
        "Fair queue in the last hour: 4 requests waited for a free slot, mean 16.00 s, longest "
        "60.00 s; 1 timed out (503), 1 refused as the queue was full (429)."
    ) in text

    day = client_for("carol").get("/models/tiny-chat/traffic?window=day", headers=HTMX)
    assert day.content.decode().lstrip().startswith('<section id="model-traffic"')
    assert (
        "Fair queue in the last day: 5 requests waited for a free slot, mean 30.80 s, longest "
        "90.00 s; 1 timed out (503), 1 refused as the queue was full (429)."
    ) in text_of(day)
    assert "Waiting for a free slot now: 0" in text_of(day)


def test_a_model_whose_requests_never_waited_says_so(client_for: Any, running: Any) -> None:
    _waits(3)
    text = text_of(client_for("alice").get("/models/tiny-chat/"))
    assert (
        "Fair queue in the last hour: no request waited for a free slot; 0 timed out (503), "
        "0 refused as the queue was full (429)."
    ) in text
