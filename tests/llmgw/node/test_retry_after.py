"""After a 503, the agent's next beat waits what the answer asked for (Retry-After), when that is
sooner than its interval: a node the gateway's gate turned away, while thousands reported at once,
comes back when told to, not an interval later."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.node.agent import MIN_RETRY_SECONDS, Agent, pause_after_failure, retry_after
from llmgw.node.config import NodeConfig

SAMPLES = 200


def test_a_503_names_the_seconds_to_wait() -> None:
    assert retry_after(503, "5") == 5.0
    assert retry_after(503, " 2 ") == 2.0
    # Only whole seconds are taken: a date, a negative number, an absurd one, none.
    assert retry_after(503, "Fri, 04 Dec 2026 19:00:00 GMT") is None
    assert retry_after(503, "-1") is None
    assert retry_after(503, "99999999999") is None
    assert retry_after(503, None) is None
    # Only a 503 asks the node to come back sooner.
    assert retry_after(200, "5") is None
    assert retry_after(500, "5") is None


@pytest.mark.parametrize(
    ("interval", "asked", "low"),
    [
        (10.0, None, 10.0),  # no answer, or none asked: the interval and a random part more
        (10.0, 5.0, 5.0),  # asked for less: that and a random part more
        (10.0, 30.0, 10.0),  # asked for more than the interval: the interval (never lost for it)
        (10.0, 0.0, MIN_RETRY_SECONDS),  # asked for nothing: not at once
    ],
)
def test_the_pause_after_a_failure(interval: float, asked: float | None, low: float) -> None:
    pauses = [pause_after_failure(interval, asked) for _ in range(SAMPLES)]
    assert all(low <= p <= 2 * low for p in pauses)
    # Spread over the range, not all at one end: a fleet turned away together comes back apart.
    assert min(pauses) < low * 1.25 and max(pauses) > low * 1.75


class Busy(http.server.BaseHTTPRequestHandler):
    """A control plane whose gate is full: every node request is answered 503, with the
    server's `retry` as Retry-After (none when None)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(503)
        retry = self.server.retry  # type: ignore[attr-defined]
        if retry is not None:
            self.send_header("Retry-After", retry)
        body = b'{"detail": "too many nodes report at once; come back later"}'
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def busy() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    server.retry = "1"  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_an_agent_turned_away_comes_back_when_told(
    busy: http.server.ThreadingHTTPServer, tmp_path: Path
) -> None:
    config = NodeConfig(
        server=f"http://127.0.0.1:{busy.server_address[1]}",
        token="llmgw-node-test",
        memory_gb=8,
        cores=4,
        cache=tmp_path / "cache",
        port_range=(43000, 43099),
        heartbeat_interval=10.0,
    )
    agent = Agent(config)
    agent.cache.prepare()
    try:
        agent.heartbeat()
        assert agent.failing and agent.retry_after == 1.0
        assert all(1.0 <= agent.next_pause() <= 2.0 for _ in range(SAMPLES))

        busy.retry = None  # type: ignore[attr-defined]
        agent.heartbeat()
        assert agent.failing and agent.retry_after is None
        assert all(10.0 <= agent.next_pause() <= 20.0 for _ in range(SAMPLES))
    finally:
        agent.session.close()
