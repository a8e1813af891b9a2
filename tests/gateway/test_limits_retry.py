"""The official `openai` client's own retry against the gateway's 429s: it waits what Retry-After
says, and that is long enough for the request in flight to end, so its one retry goes through.

The client (openai's _base_client) waits a Retry-After between 0 and 120 s exactly; without one, or
with 0, it falls back to its own backoff: 0.375-0.5 s, then 0.75-1 s. The request in flight here
ends about 0.75 s after the client's first try, between the two: a client that waited the
gateway's 1 s retries once and is let through; one that got no Retry-After (or 0) retries at
about 0.45 s, is refused a second time, and the test sees two refusals instead of one.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from access.models import GatewayKey, hash_key
from tests.gateway.fake_engine import FakeEngine

# The stream that holds the key's one request in flight: 4 events 0.375 s apart, 1.5 s in all.
HOLD_EVENTS, HOLD_DELAY = 4, 0.375
HOLD_SECONDS = HOLD_EVENTS * HOLD_DELAY
# When the client first asks, after the held stream began: 0.75 s of it are left, more than the
# client's own first backoff (0.5 s at most), less than the gateway's Retry-After (1 s).
ASK_AFTER = 0.75
REFUSED_METRIC = 'llmgw_gateway_limited_total{limit="max_parallel",subject="key"}'

pytestmark = pytest.mark.usefixtures("limit_counters")


@pytest.fixture
def chat(catalog: Any, engine: FakeEngine) -> FakeEngine:
    catalog.add("chat")
    catalog.replica("chat", engine)
    engine.delay, engine.events = HOLD_DELAY, HOLD_EVENTS  # for streams; whole answers at once
    return engine


@pytest.fixture
def one_at_a_time(keys: dict[str, str]) -> str:
    """Alice's key, allowed one request in flight (and 100 a minute, so that its answers carry
    x-ratelimit-* headers)."""
    GatewayKey.objects.filter(key_hash=hash_key(keys["alice"])).update(max_parallel=1, rpm=100)
    return keys["alice"]


def hold(gw: Any, chat: FakeEngine) -> tuple[Any, float]:
    """Start the stream that keeps the key's one request in flight; it and when it began.

    Nobody reads it until the test is done: its few small events fit in the socket's buffer,
    so the gateway ends the request (and gives its in-flight count back) when the engine
    ends the stream, whoever reads it."""
    chat.stream_started.clear()
    streaming = gw.post(
        "/v1/completions", {"model": "chat", "prompt": "hold", "stream": True}, stream=True
    )
    assert streaming.status_code == 200
    assert chat.stream_started.wait(5)
    return streaming, time.monotonic()


def refusals(gw: Any) -> float:
    for line in gw.get("/metrics").text.splitlines():
        if line.startswith(REFUSED_METRIC):
            return float(line.split()[-1])
    return 0.0


def test_it_lets_the_openai_clients_own_retry_through_after_the_retry_after(
    gw: Any, chat: FakeEngine, one_at_a_time: str
) -> None:
    import openai

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=one_at_a_time, max_retries=2)
    streaming, began = hold(gw, chat)
    time.sleep(max(0.0, began + ASK_AFTER - time.monotonic()))  # time is tested: ASK_AFTER

    asked = time.monotonic()
    raw = client.completions.with_raw_response.create(model="chat", prompt="hi")
    took = time.monotonic() - asked
    answer = raw.parse()

    assert answer.usage is not None and answer.usage.total_tokens == 8
    # Refused once (the stream still held the key's one request), waited Retry-After's 1 s,
    # which outlasted the stream, and was let through on its first retry.
    assert raw.retries_taken == 1
    assert refusals(gw) == 1.0
    assert [body["prompt"] for _, body in chat.requests] == ["hold", "hi"]
    assert 1.0 <= took < 2.0, f"the client's call took {took:.2f}s"
    assert asked + took - began >= HOLD_SECONDS - 0.1  # admitted only once the stream was over
    # The refusal counted nothing against the key's requests per minute: the stream and the
    # answer did.
    assert raw.headers["x-ratelimit-limit-requests"] == "100"
    assert raw.headers["x-ratelimit-remaining-requests"] == "98"
    assert b"[DONE]" in b"".join(streaming.iter_content(chunk_size=None))


def test_without_retries_the_openai_client_raises_rate_limit_error_saying_when(
    gw: Any, chat: FakeEngine, one_at_a_time: str
) -> None:
    import openai

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=one_at_a_time, max_retries=0)
    streaming, _ = hold(gw, chat)

    asked = time.monotonic()
    with pytest.raises(openai.RateLimitError) as raised:
        client.completions.create(model="chat", prompt="hi")
    took = time.monotonic() - asked

    error = raised.value
    assert error.status_code == 429
    assert (error.code, error.type) == ("rate_limit_exceeded", "requests")
    assert error.message.endswith(
        "This key's limit of 1 request in flight at once is reached (1 in flight); send the "
        "next one when one of them ends."
    )
    headers = error.response.headers
    # Exactly 1 s: the shortest wait the header can say, and one the client honours (0 or none
    # would make it fall back to its own, shorter backoff; more than 120 s, give up).
    assert headers["retry-after"] == "1"
    assert "retry-after-ms" not in headers  # the client would prefer it to Retry-After
    assert took < 0.5, f"no retry was asked for, yet the call took {took:.2f}s"
    assert refusals(gw) == 1.0
    assert [body["prompt"] for _, body in chat.requests] == ["hold"]
    assert b"[DONE]" in b"".join(streaming.iter_content(chunk_size=None))


def test_a_refusal_for_requests_in_flight_says_where_the_per_minute_limits_stand(
    gw: Any, chat: FakeEngine, one_at_a_time: str
) -> None:
    import openai

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=one_at_a_time, max_retries=0)
    streaming, _ = hold(gw, chat)
    try:
        with pytest.raises(openai.RateLimitError) as raised:
            client.completions.create(model="chat", prompt="hi")
        headers = raised.value.response.headers
        # After the stream, which counted; the refusal did not.
        assert headers.get("x-ratelimit-limit-requests") == "100"
        assert headers.get("x-ratelimit-remaining-requests") == "99"
    finally:
        streaming.close()
