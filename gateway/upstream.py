"""HTTP/1.1 to the engines: kept connections, a request written in one piece, the answer read by
httptools' parser on an asyncio Protocol.

Why not aiohttp (which reached the engines before): per request its client built a request and
a response object, their header multidicts, a payload, trace signals and a timer, about a third of
what a gateway worker spent on a whole answer (bench/gateway_profile.py). The engines speak
plain HTTP/1.1 on a private address, and the gateway asks one thing of them: POST a JSON body,
read the status, the content type and the body, whole or as it comes. That is this module.

Bounds: a pool keeps the connections idle since the last request to each engine address, at
most as many as were in use at once, and closes any idle for IDLE_SECONDS (`Pool.size` says how
many it holds). A whole answer is read up to MAX_ANSWER_BYTES; a stream holds at most
READ_HIGH_BYTES unread before it stops reading from the engine until the client catches up.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from typing import Any

import httptools

# How long a connection may sit idle in the pool: less than engines keep an idle connection
# open (both engines' servers after 5 s), so that the gateway is not the one to find
# it closed (see proxy.IDLE_SECONDS), and long enough that a gap of a few seconds between two
# bursts does not make every request of the next one connect anew.
IDLE_SECONDS = 4.0
CONNECT_TIMEOUT_SECONDS = 5.0
# A whole answer larger than this is an engine gone wrong (or a hostile node): refused.
MAX_ANSWER_BYTES = 256 * 1024 * 1024
# A stream's unread bytes above which reading from the engine pauses.
READ_HIGH_BYTES = 256 * 1024


class NotConnected(Exception):
    """The connection could not be made (refused, unreachable, timed out)."""


class Lost(Exception):
    """The connection failed or closed before the answer was whole. `answered`: whether any of
    the answer had come."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


class Silent(Exception):
    """The engine said nothing for the read timeout."""


class Connection(asyncio.Protocol):
    """One kept connection to an engine, with the answer it is reading."""

    def __init__(self, pool: Pool, address: tuple[str, int]) -> None:
        self.pool, self.address = pool, address
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.reused = False
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = self.deadline = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = b""
        self.headed = False  # the status line and headers are in
        self.complete = False  # the whole answer is in
        self.keep_alive = False
        self.error: BaseException | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol --

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Lost(f"the engine's answer is not HTTP: {exc}", answered=True))
            self.close()

    def eof_received(self) -> bool:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.pool.forget(self)
        if not self.complete:
            reason = f"{type(exc).__name__}: {exc}" if exc else "the engine closed the connection"
            self._fail(Lost(reason, answered=self.headed))

    # -- httptools' callbacks --

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headed = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > READ_HIGH_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- the request --

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, timeout: float) -> None:
        """Until the parser has more to say (or the connection fails), at most `timeout`.

        One timer a connection, not one a wait (a stream waits once an event): it goes off at
        the deadline it was set for, and when a later wait has moved the deadline on, it is set
        again for that."""
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.deadline = loop.time() + timeout
        if self.timer is None or self.timer_at > self.deadline:
            if self.timer is not None:
                self.timer.cancel()
            self.timer_at = self.deadline
            self.timer = loop.call_at(self.deadline, self._expire)
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _expire(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self.deadline:
            self.timer_at = self.deadline
            self.timer = loop.call_at(self.deadline, self._expire)
        else:
            waiter.set_exception(Silent())

    def write(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        if len(body) <= 64 * 1024:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    async def head(self, timeout: float) -> None:
        """Until the answer's status line and headers are in."""
        while not self.headed:
            if self.error is not None:
                raise self.error
            await self._wait(timeout)

    async def read(self, timeout: float) -> bytes:
        """What has come of the body since the last read, waiting for some; b"" at its end."""
        while True:
            if self.chunks:
                data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
                self.chunks.clear()
                self.buffered = 0
                if self.paused and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return data
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait(timeout)

    async def whole(self, timeout: float) -> bytes:
        """The rest of the body, once it is all in (at most MAX_ANSWER_BYTES)."""
        parts: list[bytes] = []
        size = 0
        while True:
            data = await self.read(timeout)
            if not data:
                return b"".join(parts)
            size += len(data)
            if size > MAX_ANSWER_BYTES:
                self.close()
                raise Lost(
                    f"the engine's answer is larger than {MAX_ANSWER_BYTES} bytes", answered=True
                )
            parts.append(data)

    def done(self) -> None:
        """The answer is read (or given up): the connection goes back to the pool when it can
        carry another request, else it is closed."""
        if self.complete and self.keep_alive and not self.closed and not self.chunks:
            self._reset()
            self.pool.give_back(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class Pool:
    """The gateway process's kept connections to the engines, by address."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[Connection]] = {}

    def size(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def connection(self, host: str, port: int, *, fresh: bool = False) -> Connection:
        """A kept connection to host:port (the one idle for the least time), or a new one;
        `fresh`: always a new one."""
        address = (host, port)
        idle = self._idle.get(address)
        if idle and not fresh:
            now = time.monotonic()
            _drop_stale(idle, now)
            while idle:
                found = idle.pop()
                if not found.closed:
                    found.reused = True
                    return found
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
                _, made = await loop.create_connection(
                    lambda: Connection(self, address), host, port
                )
        except (OSError, TimeoutError) as exc:
            raise NotConnected(f"cannot connect to {host}:{port}: {exc or 'timed out'}") from exc
        return made

    def give_back(self, found: Connection) -> None:
        now = time.monotonic()
        found.idle_since = now
        idle = self._idle.setdefault(found.address, [])
        _drop_stale(idle, now)
        idle.append(found)

    def forget(self, found: Connection) -> None:
        """A connection closed: out of the pool, if it was there."""
        idle = self._idle.get(found.address)
        if idle and found in idle:
            idle.remove(found)
            if not idle:
                del self._idle[found.address]

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for found in connections:
                found.close()


def _drop_stale(idle: list[Connection], now: float) -> None:
    """Close the connections idle for longer than IDLE_SECONDS (the oldest are first)."""
    stale = 0
    while stale < len(idle) and now - idle[stale].idle_since > IDLE_SECONDS:
        stale += 1
    if stale:
        for found in idle[:stale]:
            found.closed = True
            if found.transport is not None:
                found.transport.close()
        del idle[:stale]


def request_head(
    method: str,
    host: str,
    port: int,
    path: str,
    headers: dict[str, str],
    length: int,
    more: dict[str, str] | None = None,
) -> bytes:
    """A request's line and header fields: `headers` (a replica's, the same for each of its
    requests), then `more` (this request's); a CR or LF in any of them is refused (ValueError).
    What stays the same between a replica's requests is written and checked once
    (`_head_start`)."""
    start = _head_start(method, host, port, path, tuple(headers.items()))
    lines = [f"{name}: {value}" for name, value in more.items()] if more else []
    if lines and any("\r" in line or "\n" in line for line in lines):
        raise ValueError("a header of the engine's request holds a line break")
    lines.append(f"Content-Length: {length}\r\n\r\n")
    return start + "\r\n".join(lines).encode("latin-1")


@functools.lru_cache(maxsize=4096)
def _head_start(
    method: str, host: str, port: int, path: str, headers: tuple[tuple[str, str], ...]
) -> bytes:
    """The request line, Host and `headers`, each line ended (bounded: replicas times paths)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    if any("\r" in line or "\n" in line for line in lines):
        raise ValueError("a header of the engine's request holds a line break")
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")
