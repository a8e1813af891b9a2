"""A reverse proxy for tests that hands out file downloads slowly, everything else at once.

    with slow_proxy(upstream, bytes_per_second=200_000) as url:
        ...  # url answers as upstream does; GETs under /resolve/ trickle at that rate

The fault matrix puts it in front of its registry (olah) so that fetching a tiny weights file
into the mirror lasts long enough for a fault to land in it. It listens on 127.0.0.1 on a free
port; a Location header naming the upstream is rewritten to name the proxy, so a redirect stays
behind it. Stopped when the block exits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import requests

CHUNK_BYTES = 16 * 1024
# Not passed on either way: hop-by-hop headers, and those that describe the upstream's framing
# (the proxy sends the body as requests decoded it).
DROPPED = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-encoding",
    "content-length",
}


def _handler_class(upstream: str, own: list[str], rate: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._forward()

        def do_HEAD(self) -> None:
            self._forward()

        def do_POST(self) -> None:
            self._forward()

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in DROPPED}
            try:
                answer = requests.request(
                    self.command,
                    upstream + self.path,
                    headers=headers,
                    data=body,
                    allow_redirects=False,
                    stream=True,
                    timeout=(10, 120),
                )
            except requests.RequestException:
                self.send_error(502)
                return
            with answer:
                slow = self.command == "GET" and "/resolve/" in self.path
                content = b"" if self.command == "HEAD" else None
                if content is None and not slow:
                    content = answer.content
                self.send_response(answer.status_code)
                for name, value in answer.headers.items():
                    if name.lower() in DROPPED:
                        continue
                    if name.lower() == "location" and value.startswith(upstream):
                        value = own[0] + value[len(upstream) :]
                    self.send_header(name, value)
                if self.command == "HEAD":
                    size = answer.headers.get("Content-Length")
                    if size is not None:
                        self.send_header("Content-Length", size)
                    self.end_headers()
                    return
                if content is not None:
                    self.send_header("Content-Length", str(len(content)))
                    self.end_headers()
                    self.wfile.write(content)
                    return
                # The file, slowly: its length when the upstream sent it plainly, else the
                # connection's end marks the body's.
                size = answer.headers.get("Content-Length")
                if size is not None and not answer.headers.get("Content-Encoding"):
                    self.send_header("Content-Length", size)
                else:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                try:
                    for chunk in answer.iter_content(CHUNK_BYTES):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        time.sleep(len(chunk) / rate)  # paces the download: time is the point
                except (requests.RequestException, OSError):
                    self.close_connection = True

    return Handler


@contextmanager
def slow_proxy(upstream: str, *, bytes_per_second: float) -> Iterator[str]:
    upstream = upstream.rstrip("/")
    own: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(upstream, own, bytes_per_second))
    server.daemon_threads = True
    own.append(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield own[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
