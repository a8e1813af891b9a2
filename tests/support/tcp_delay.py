"""A TCP proxy that holds back or delays what its clients send, for tests and benches that need a
slow or silent server (Redis, say) without changing the server.

    with TcpDelay(upstream_port, delay=0.2) as proxy:
        proxy.port           # connect here: each chunk a client sends reaches the upstream
                             # `delay` seconds later (answers come back at once)
        proxy.hold()         # from now on nothing a client sends goes on...
        proxy.held           # ...and this counts the chunks waiting
        proxy.release()      # ...until released (what was held goes on, in order)
        proxy.refuse = True  # new connections are closed at once (the server is "down")

It listens on 127.0.0.1 on a free port, a thread per direction of each connection; closed,
with its connections, when the block exits.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from typing import Any

from tests.support.ports import free_port


class TcpDelay:
    def __init__(self, upstream_port: int, *, delay: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay = delay
        self.refuse = False
        self.port = free_port()
        self._holding = False
        self._changed = threading.Condition()
        self._queued: list[deque[tuple[float, bytes]]] = []
        self._sockets: list[socket.socket] = []
        self._closing = False
        self._listener = socket.create_server(("127.0.0.1", self.port), backlog=128)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def __enter__(self) -> TcpDelay:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def held(self) -> int:
        """Chunks clients sent that wait to go on (held, or still within their delay)."""
        with self._changed:
            return sum(len(queue) for queue in self._queued)

    def hold(self) -> None:
        with self._changed:
            self._holding = True

    def release(self) -> None:
        with self._changed:
            self._holding = False
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._listener.close()
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    # -- the connections ----------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refuse:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            queue: deque[tuple[float, bytes]] = deque()
            with self._changed:
                self._queued.append(queue)
            for target, args in (
                (self._read_client, (client, queue)),
                (self._send_upstream, (upstream, queue)),
                (self._answer, (upstream, client)),
            ):
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                self._threads.append(thread)

    def _read_client(self, client: socket.socket, queue: deque[tuple[float, bytes]]) -> None:
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            with self._changed:
                queue.append((time.monotonic() + self.delay, data))
                self._changed.notify_all()
            if not data:
                return

    def _send_upstream(self, upstream: socket.socket, queue: deque[tuple[float, bytes]]) -> None:
        while True:
            with self._changed:
                while not self._closing and (self._holding or not queue):
                    self._changed.wait()
                if self._closing:
                    return
                due, data = queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # paces the chunks: the delay is what this proxy is for
            with self._changed:
                if self._holding:
                    continue
                queue.popleft()
            if not data:
                with contextlib.suppress(OSError):
                    upstream.shutdown(socket.SHUT_WR)
                return
            try:
                upstream.sendall(data)
            except OSError:
                return

    def _answer(self, upstream: socket.socket, client: socket.socket) -> None:
        while True:
            try:
                data = upstream.recv(65536)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_WR)
                return
            try:
                client.sendall(data)
            except OSError:
                return
