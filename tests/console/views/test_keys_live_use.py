"""The Keys page shows each key's use now against its rpm, tpm and in-flight limits, read from
the gateway processes' files once for the page."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from access import live
from access.services import key_create
from core.actor import Actor
from gateway.limits import SharedCounters
from tests.console.pages import text_of
from tests.support.gateway_files import admit, gateway_files

pytestmark = [pytest.mark.django_db]

HTMX = {"HX-Request": "true", "HX-Current-URL": "http://testserver/keys/"}


@pytest.fixture
def counters(tmp_path: Path, settings: Any) -> Iterator[SharedCounters]:
    with gateway_files(tmp_path, settings) as mine:
        yield mine


def test_the_page_shows_use_now_against_each_rate(
    client_for: Any,
    users: dict[str, Any],
    counters: SharedCounters,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    actor = Actor.for_user(users["alice"], "api")
    busy = key_create(actor=actor, name="busy", limits={"rpm": 60, "max_parallel": 2})[0]
    key_create(actor=actor, name="idle", limits={"tpm": 1000})
    key_create(actor=actor, name="free", limits={})
    admit(counters, busy)
    counters.release(admit(counters, busy), tokens=300)
    reads: list[int] = []
    real = live.use_now
    monkeypatch.setattr(live, "use_now", lambda **asked: reads.append(1) or real(**asked))

    text = text_of(client_for("alice").get("/keys/"))
    assert "Requests in the last minute 2 of 60 (3%)" in text
    assert "Tokens in the last minute 300, no limit" in text
    assert "In flight now 1 of 2 (50%)" in text
    assert "Tokens in the last minute 0 of 1,000 (0%)" in text  # idle's
    # free has no limit: the gateway does not count it, and the page says so instead of 0.
    assert text.count("The gateway counts its use per minute and in flight once it has a") == 1
    assert len(reads) == 1


def test_a_changed_keys_card_shows_its_use_now(
    client_for: Any, users: dict[str, Any], counters: SharedCounters
) -> None:
    key = key_create(
        actor=Actor.for_user(users["alice"], "api"), name="bot", limits={"max_parallel": 2}
    )[0]
    admit(counters, key)
    response = client_for("alice").post(
        f"/keys/{key.pk}/limits", {"max_parallel": "3", "weight": "1"}, headers=HTMX
    )
    assert response.status_code == 200, text_of(response)
    assert "In flight now 1 of 3 (33%)" in text_of(response)
