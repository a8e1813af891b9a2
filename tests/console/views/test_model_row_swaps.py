"""A model's row in the models list as Update, Roll back and a rollout's poll swap it in: the
same row as the page's, its "Last hour" sparkline included."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from access.traffic import TrafficBook
from tests.console.pages import HTMX, row_of
from tests.console.views.test_model_registry import from_the_registry

pytestmark = [pytest.mark.django_db]


def some_traffic(model: str, minutes_ago: list[int]) -> None:
    book = TrafficBook("test")
    now = datetime.now(UTC)
    for ago in minutes_ago:
        for _ in range(3):
            moment = now - timedelta(minutes=ago)
            book.record(
                model=model,
                key_id=None,
                status=200,
                seconds=0.2,
                completion=2,
                at=moment.timestamp(),
            )
    book.flush()


def sparkline_of(row: str) -> str:
    found = re.search(r'<td class="traffic" data-label="Last hour">(.*?)</td>', row, re.S)
    assert found is not None, row
    return found.group(1).strip()


@pytest.mark.parametrize("button", ["update", "rollback"])
def test_it_keeps_the_sparkline_in_a_row_swapped_in_by_a_button(
    client_for: Any, running: Any, button: str
) -> None:
    from_the_registry(size=400_000, new_size=500_000, previous=True)
    some_traffic("tiny-chat", [1, 4, 7, 20])
    client = client_for("alice")
    on_the_page = sparkline_of(row_of(client.get("/").content.decode(), "tiny-chat"))
    assert "tiny-chat: requests per minute: 12 in the last hour" in on_the_page

    response = client.post(f"/models/tiny-chat/{button}", {"in": "list"}, headers=HTMX)

    assert response.status_code == 200
    swapped = response.content.decode()
    assert swapped.lstrip().startswith('<tr id="model-tiny-chat"')
    assert sparkline_of(swapped) == on_the_page


def test_it_keeps_the_sparkline_in_a_row_the_rollouts_poll_swaps_in(
    client_for: Any, running: Any
) -> None:
    from_the_registry(size=400_000, new_size=500_000)
    some_traffic("tiny-chat", [2, 5])
    client = client_for("alice")
    client.post("/models/tiny-chat/update", {"in": "list"}, headers=HTMX)
    on_the_page = sparkline_of(row_of(client.get("/").content.decode(), "tiny-chat"))
    assert 'data-points="2"' in on_the_page

    polled = client.get("/models/tiny-chat/registry?in=list", headers=HTMX).content.decode()

    assert sparkline_of(polled) == on_the_page
