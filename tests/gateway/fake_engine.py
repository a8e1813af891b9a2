"""A stand-in for a llama.cpp engine: OpenAI-style answers and SSE streams, on 127.0.0.1.

    with fake_engine() as engine:
        engine.port, engine.requests  # what it was asked, as (path, body) pairs
        engine.request_ids            # the X-Request-ID each came with (None: none)
        engine.mode = "reset"         # close the connection instead of answering
        engine.answers[path] = {...}  # the whole answer to a path, instead of a completion
        engine.streams[path] = [...]  # the events of a stream to a path, sent as they are

Streams use chunked encoding with one event per chunk, as uvicorn sends them, and
wait `engine.delay` seconds between events so that a test can see them arrive one
by one. Stopped, its threads joined, when the block exits.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class FakeEngine:
    port: int = 0
    mode: str = "ok"  # ok | reset | error | silent (says nothing for 1.5 s)
    delay: float = 0.0
    events: int = 4
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)
    traceparents: list[str | None] = field(default_factory=list)
    stream_started: threading.Event = field(default_factory=threading.Event)
    answers: dict[str, Any] = field(default_factory=dict)
    streams: dict[str, list[bytes]] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [body.get("model") for _, body in self.requests]


@contextmanager
def fake_engine() -> Iterator[FakeEngine]:
    engine = FakeEngine()

    class Handler(_Handler):
        pass

    Handler.engine = engine
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = False
    server.block_on_close = True
    engine.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield engine
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    engine: FakeEngine
    protocol_version = "HTTP/1.1"
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.engine.request_ids.append(self.headers.get("X-Request-ID"))
        self.engine.traceparents.append(self.headers.get("traceparent"))
        self.engine.requests.append((self.path, body))
        self.close_connection = True
        if self.engine.mode == "reset":
            # Took the request, then went away without a word (an engine stopped mid-queue).
            self.connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            self.connection.close()
            return
        if self.engine.mode == "silent":
            time.sleep(1.5)  # time is what is tested: longer than the timeout the test sets
            return
        if self.engine.mode == "error":
            self._json(500, {"detail": "the engine fell over"})
            return
        model = body.get("model")
        path = self.path.split("?", 1)[0]
        if body.get("stream") and path in self.engine.streams:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._events(self.engine.streams[path])
        elif path in self.engine.answers:
            self._json(200, self.engine.answers[path])
        elif body.get("stream"):
            # A client may hang up mid-stream.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._stream(model)
        elif self.path.endswith("/embeddings"):
            self._json(
                200,
                {
                    "object": "list",
                    "model": model,
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                    "usage": {"prompt_tokens": 2, "total_tokens": 2},
                },
            )
        else:
            self._json(
                200,
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": model,
                    "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
                },
            )

    def _json(self, status: int, data: Any) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _stream(self, model: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.engine.stream_started.set()
        for index in range(self.engine.events):
            event = {
                "model": model,
                "object": "text_completion",
                "choices": [{"index": 0, "text": f"t{index}", "finish_reason": None}],
            }
            self._chunk(b"data: " + json.dumps(event).encode() + b"\r\n\r\n")
            time.sleep(self.engine.delay)  # paces the stream: a slow engine, as the test set it
        self._chunk(b"data: [DONE]\r\n\r\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _events(self, events: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.engine.stream_started.set()
        for event in events:
            self._chunk(event)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()
