"""The gateway counts what it answers into the traffic figures and each key's usage."""

from __future__ import annotations

from typing import Any

import pytest

from access import traffic
from access.models import GatewayKey, KeyUsageDay, TrafficMinute
from tests.gateway.fake_engine import FakeEngine


@pytest.fixture
def book(monkeypatch: pytest.MonkeyPatch) -> traffic.TrafficBook:
    from tests.support.gateway_state import current_state

    fresh = traffic.TrafficBook("test")
    monkeypatch.setattr(current_state(), "book", fresh)  # the gateway's (gateway.app.Gateway.book)
    return fresh


def test_answers_are_counted_per_model_and_key(
    gw: Any, catalog: Any, engine: FakeEngine, keys: dict[str, str], book: traffic.TrafficBook
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    for _ in range(2):
        assert gw.post("/v1/completions", {"model": "chat", "prompt": "a"}).status_code == 200
    engine.events = 4
    streamed = gw.post(
        "/v1/completions", {"model": "chat", "prompt": "a", "stream": True}, stream=True
    )
    assert b"[DONE]" in streamed.content
    engine.mode = "error"  # the engine answers 500: a server error of the model's
    assert (
        gw.post("/v1/completions", {"model": "chat", "prompt": "a"}, key=keys["bob"]).status_code
        == 500
    )
    assert gw.post("/v1/completions", {"model": "nope", "prompt": "a"}).status_code == 404
    book.flush()

    row = TrafficMinute.objects.get(model="chat")
    assert (row.requests, row.client_errors, row.server_errors) == (4, 0, 1)
    assert (row.prompt_tokens, row.completion_tokens) == (6, 10 + 4)
    assert sum(row.latency_buckets) == 4 and row.seconds > 0
    assert not TrafficMinute.objects.filter(model="nope").exists()
    alice = GatewayKey.objects.get(owner__username="alice")
    usage = {(u.key_id, u.requests, u.completion_tokens) for u in KeyUsageDay.objects.all()}
    bob = GatewayKey.objects.get(owner__username="bob")
    assert usage == {(alice.id, 3, 14), (bob.id, 1, 0)}
