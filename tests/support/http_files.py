"""A small threaded HTTP file server for tests, with or without support for Range requests.

    with serve_directory(tmp_path) as (base_url, stats):
        requests.get(f"{base_url}/model.gguf", headers={"Range": "bytes=0-99"})
    assert stats.bytes_sent == 100   # final once the block has exited

It listens on 127.0.0.1 on a free port and is stopped (and its handler threads joined) when the
``with`` block exits. ``stats`` counts the body bytes the server actually handed to the socket,
so a test can prove a client did not download a whole file. The socket send buffer is kept
small so that, when a client hangs up early, little data sits unread in kernel buffers and the
count stays close to what the client really consumed.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

CHUNK_BYTES = 64 * 1024
SEND_BUFFER_BYTES = 64 * 1024
HANDLER_TIMEOUT_SECONDS = 10.0

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    range: str | None  # the request's Range header, as sent
    status: int
    body_bytes: int  # body bytes handed to the socket for this request


@dataclass
class ServerStats:
    """What the server did; read it after the ``with`` block for final numbers."""

    requests: list[RequestRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return sum(record.body_bytes for record in self.requests)

    @property
    def request_count(self) -> int:
        with self._lock:
            return len(self.requests)

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self.requests.append(record)


@contextmanager
def serve_directory(
    path: str | Path, *, honour_range: bool = True
) -> Iterator[tuple[str, ServerStats]]:
    """Serve the files under ``path``; yields (base_url, stats).

    With ``honour_range=False`` the server behaves like one that ignores Range: it always
    answers 200 with the whole file.
    """
    root = Path(path).resolve()
    stats = ServerStats()
    handler = _handler_class(root, honour_range, stats)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # Joined handler threads make the stats final when the block exits.
    server.daemon_threads = False
    server.block_on_close = True
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host!s}:{port}", stats
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=HANDLER_TIMEOUT_SECONDS)


def _handler_class(
    root: Path, honour_range: bool, stats: ServerStats
) -> type[BaseHTTPRequestHandler]:
    class FileHandler(_FileHandler):
        pass

    FileHandler.root = root
    FileHandler.honour_range = honour_range
    FileHandler.stats = stats
    return FileHandler


class _FileHandler(BaseHTTPRequestHandler):
    root: Path
    honour_range: bool
    stats: ServerStats
    timeout = HANDLER_TIMEOUT_SECONDS  # a client that stops reading cannot pin a thread forever
    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers after a test

    def setup(self) -> None:
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def _serve(self, *, send_body: bool) -> None:
        file = self._resolve()
        if file is None:
            self._reply_empty(404)
            return
        size = file.stat().st_size
        requested = self.headers.get("Range")
        byte_range = _parse_range(requested, size) if self.honour_range else None
        if byte_range == "unsatisfiable":
            self._reply_empty(416, {"Content-Range": f"bytes */{size}"})
            return
        start, end = byte_range if isinstance(byte_range, tuple) else (0, size - 1)
        status = 206 if isinstance(byte_range, tuple) else 200
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes" if self.honour_range else "none")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        sent = self._send_file(file, start, end - start + 1) if send_body else 0
        self.stats.add(RequestRecord(self.command, self.path, requested, status, sent))

    def _resolve(self) -> Path | None:
        relative = unquote(urlsplit(self.path).path).lstrip("/")
        candidate = (self.root / relative).resolve()
        if not candidate.is_relative_to(self.root) or not candidate.is_file():
            return None
        return candidate

    def _reply_empty(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.stats.add(RequestRecord(self.command, self.path, self.headers.get("Range"), status, 0))

    def _send_file(self, file: Path, start: int, length: int) -> int:
        """Send ``length`` bytes from ``start``; return how many the socket accepted."""
        sent = 0
        with file.open("rb") as body:
            body.seek(start)
            while sent < length:
                chunk = body.read(min(CHUNK_BYTES, length - sent))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    break  # the client hung up: exactly what a header reader should do
                sent += len(chunk)
        return sent


def _parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """A single "bytes=a-b" range as (start, end) inclusive, "unsatisfiable", or None (ignore).

    Malformed or multi-range headers are ignored (a full 200 answer), as RFC 9110 allows.
    """
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.group(1), match.group(2)
    if first == "":  # a suffix range: the last N bytes
        length = int(last)
        if length == 0:
            return "unsatisfiable"
        return max(0, size - length), size - 1
    start = int(first)
    if last != "" and int(last) < start:
        return None  # syntactically invalid: ignored, not refused
    if start >= size:
        return "unsatisfiable"
    end = size - 1 if last == "" else min(int(last), size - 1)
    return start, end
