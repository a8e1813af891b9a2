"""A fake control plane for node agent tests: just the heartbeat endpoint.

    with fake_control_plane(token="t") as plane:
        plane.want([{"id": "r1", "model": "tiny-chat", "source": url, ...}])
        report = plane.wait_for(lambda r: plane.replica(r, "r1")["state"] == "ready")

It listens on 127.0.0.1 on a free port and answers ``POST /api/v1/node/heartbeat`` as the real
one does: 401 for another token, else 200 with the replicas the test wants, or, once ``remove``
was called, 410 for its token as the real one answers a removed node's. Every heartbeat the agent
sends is recorded; ``answer_with`` replaces the answer (an error, garbage) until
``answer_normally``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from tests.support import waiting

HEARTBEAT_PATH = "/api/v1/node/heartbeat"

T = TypeVar("T")


@dataclass(frozen=True)
class Heartbeat:
    received_at: float  # time.monotonic()
    authorization: str | None
    body: Any  # the parsed JSON, or the raw text when it was not JSON


class FakeControlPlane:
    def __init__(self, token: str, node: str = "node-a", heartbeat_interval: float = 0.2) -> None:
        self.token = token
        self.node = node
        self.heartbeat_interval = heartbeat_interval
        self.url = ""
        self._lock = threading.Lock()
        self._wanted: list[dict[str, Any]] = []
        self._keep: list[dict[str, Any]] = []
        self._override: tuple[int, bytes] | None = None
        self._heartbeats: list[Heartbeat] = []
        self._removed: dict[str, str] | None = None

    # -- what the test sets -------------------------------------------------------------------

    def want(
        self, replicas: list[dict[str, Any]], keep: list[dict[str, Any]] | None = None
    ) -> None:
        """The replicas the agent should run, and the files it should keep cached anyway."""
        with self._lock:
            self._wanted = [dict(replica) for replica in replicas]
            self._keep = [dict(item) for item in keep or []]

    def answer_with(self, status: int, body: bytes | str | dict[str, Any]) -> None:
        """Answer every heartbeat with this, whatever the token, until answer_normally()."""
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        with self._lock:
            self._override = (status, raw.encode() if isinstance(raw, str) else raw)

    def remove(self, *, by: str = "alice", at: str = "2026-12-07 13:02:11") -> str:
        """Answer the node's token from now on as the real control plane answers a removed
        node's (fleet.api.NodeRemoved); returns the sentence it answers."""
        detail = (
            f"This node ({self.node}) was removed by {by} at {at} UTC; the control plane no "
            "longer takes its token. To run replicas on this machine again, add the node again "
            f"(`llmgw ctl node add {self.node}`) and start its agent with the new token."
        )
        with self._lock:
            self._removed = {"detail": detail, "code": "node_removed"}
        return detail

    def answer_normally(self) -> None:
        with self._lock:
            self._override = None

    # -- what the agent reported --------------------------------------------------------------

    @property
    def heartbeats(self) -> list[Heartbeat]:
        with self._lock:
            return list(self._heartbeats)

    def count(self) -> int:
        with self._lock:
            return len(self._heartbeats)

    def last(self) -> dict[str, Any] | None:
        with self._lock:
            for heartbeat in reversed(self._heartbeats):
                if isinstance(heartbeat.body, dict):
                    return heartbeat.body
        return None

    @staticmethod
    def replica(report: dict[str, Any] | None, replica_id: str) -> dict[str, Any] | None:
        if report is None:
            return None
        for replica in report.get("replicas", []):
            if replica.get("id") == replica_id:
                return replica
        return None

    def wait_for(
        self,
        condition: Callable[[dict[str, Any]], T],
        *,
        timeout: float = 20,
        what: str = "the condition",
        since: int = 0,
    ) -> T:
        """Wait for a heartbeat (the ``since``-th or later) for which ``condition`` is truthy;
        return what it returned. Each heartbeat is looked at once, in the order received."""
        seen = since

        def fresh_match() -> T | None:
            nonlocal seen
            with self._lock:
                fresh = self._heartbeats[seen:]
                seen = len(self._heartbeats)
            for heartbeat in fresh:
                if isinstance(heartbeat.body, dict):
                    result = condition(heartbeat.body)
                    if result:
                        return result
            return None

        try:
            # not_yet=(): a condition that raises fails the wait, since the heartbeat it
            # raised on would not be looked at again.
            return waiting.wait_for(fresh_match, timeout=timeout, what=what, not_yet=())
        except AssertionError as timed_out:
            raise AssertionError(
                f"{timed_out}; last heartbeat: {json.dumps(self.last(), indent=1)}"
            ) from None

    # -- the server side ----------------------------------------------------------------------

    def _answer(self, authorization: str | None, raw_body: bytes) -> tuple[int, bytes]:
        try:
            body: Any = json.loads(raw_body)
        except ValueError:
            body = raw_body.decode(errors="replace")
        with self._lock:
            self._heartbeats.append(Heartbeat(time.monotonic(), authorization, body))
            if self._override is not None:
                return self._override
            if authorization != f"Bearer {self.token}":
                return 401, json.dumps({"detail": "Invalid token."}).encode()
            if self._removed is not None:
                return 410, json.dumps(self._removed).encode()
            answer = {
                "node": self.node,
                "heartbeat_interval": self.heartbeat_interval,
                "replicas": self._wanted,
                "keep": self._keep,
            }
        return 200, json.dumps(answer).encode()


@contextmanager
def fake_control_plane(
    token: str = "node-token", *, heartbeat_interval: float = 0.2
) -> Iterator[FakeControlPlane]:
    plane = FakeControlPlane(token, heartbeat_interval=heartbeat_interval)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path != HEARTBEAT_PATH:
                status, body = 404, b'{"detail": "Not found."}'
            else:
                status, body = plane._answer(self.headers.get("Authorization"), raw)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    host, port = server.server_address[:2]
    plane.url = f"http://{host!s}:{port}"
    try:
        yield plane
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
