"""An HTTP server on 127.0.0.1 that answers every request with a redirect, for SSRF tests.

    with serve_redirects("http://localhost:9999/") as (base_url, stats):
        ...  # GET {base_url}/a/b -> 302 Location: http://localhost:9999/a/b

The target is joined with the request's path (without its leading '/'), so a client that
follows the redirect asks the target for the same file. Stopped when the block exits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .http_files import RequestRecord, ServerStats


@contextmanager
def serve_redirects(target: str, *, status: int = 302) -> Iterator[tuple[str, ServerStats]]:
    stats = ServerStats()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"
        timeout = 10

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _redirect(self) -> None:
            self.send_response(status)
            self.send_header("Location", target + self.path.lstrip("/"))
            self.send_header("Content-Length", "0")
            self.end_headers()
            stats.add(RequestRecord(self.command, self.path, self.headers.get("Range"), status, 0))

        do_GET = do_HEAD = _redirect

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = False
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host!s}:{port}", stats
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
