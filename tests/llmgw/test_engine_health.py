"""llmgw.engine.health: what the node agent is told of an engine's /health, loading or serving."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw import engine
from tests.support.ports import free_port


@pytest.fixture
def answering() -> Iterator[tuple[int, list[int]]]:
    """A server whose /health answers with the status last put in the list."""
    statuses = [503]

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"error": {"code": 503, "message": "Loading model"}}'
            self.send_response(statuses[-1])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server.server_address[1], statuses
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_loading_engine_is_told_by_its_status_and_a_serving_one_by_none(
    answering: tuple[int, list[int]],
) -> None:
    port, statuses = answering
    assert engine.health("127.0.0.1", port, timeout=5) == "HTTP 503"
    statuses.append(200)
    assert engine.health("127.0.0.1", port, timeout=5) is None


def test_nothing_listening_is_named_by_the_error() -> None:
    assert engine.health("127.0.0.1", free_port(), timeout=5) == "ConnectionError"
