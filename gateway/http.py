"""The HTTP plumbing every part of the gateway shares: ASGI's types, the one place an answer's
status line and headers are written, bounded body reads and the pump that passes a stream on.

Why one response-start helper: the gateway once wrote `http.response.start` by hand in three
places (a whole answer, a stream, the web's answer), and each had to remember which headers every
answer carries; now each says only what is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from core import requestid

from . import conf
from .errors import Refusal

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON: Headers = [(b"content-type", b"application/json")]


async def start(send: Send, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Begin the answer: its status and headers (ASGI's http.response.start), and the
    request's X-Request-ID, which every answer carries."""
    headers = list(headers)
    request_id = requestid.current.get()
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def whole(
    send: Send,
    status: int,
    body: bytes,
    headers: Headers | None = None,
    extra: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """An answer in one piece: `headers` (JSON's content type unless given), then `extra`."""
    await start(
        send,
        status,
        [*(headers or JSON), *extra, (b"content-length", str(len(body)).encode())],
    )
    await send({"type": "http.response.body", "body": body})


async def refuse(send: Send, refusal: Refusal, extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    headers = [*JSON, *((k.lower().encode(), v.encode()) for k, v in refusal.headers.items())]
    await whole(send, refusal.status, refusal.body(), headers, extra)


def header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


# -- request bodies -----------------------------------------------------------------------


class TooBig(Exception):
    pass


class Disconnected(Exception):
    pass


class Slow(Exception):
    """The body stopped arriving for longer than conf.body_seconds()."""


class TooSlow(Slow):
    """The body was not whole by its pace's deadline ("deadline"), or came slower than its
    minimum rate ("rate")."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# The first seconds of a body, which its minimum rate does not count: a client may send the
# head and start the body a moment later (after a 100 Continue, say).
RATE_GRACE_SECONDS = 5.0


@dataclass(frozen=True)
class Pace:
    """What a body must keep up besides the pause limit: to be whole within `deadline` seconds
    and, after its first RATE_GRACE_SECONDS, to average `min_rate` bytes a second (0: no floor).
    A client trickling a byte now and then holds its connection seconds, not minutes."""

    deadline: float
    min_rate: float

    def due(self, started: float, received: int) -> tuple[float, str]:
        """When the body fails its pace with `received` bytes come, and why then."""
        due, reason = started + self.deadline, "deadline"
        if self.min_rate > 0:
            by_rate = started + RATE_GRACE_SECONDS + received / self.min_rate
            if by_rate < due:
                due, reason = by_rate, "rate"
        return due, reason


async def read_body(
    receive: Receive,
    limit: int,
    *,
    pace: Pace | None = None,
    charge: Callable[[int], None] | None = None,
) -> bytes:
    """The whole body, up to `limit` bytes (TooBig past it); a client that pauses longer than
    conf.body_seconds() between two pieces is Slow, one that falls behind `pace` TooSlow.

    `charge` is called with each piece's size before the piece is kept (the bytes are held
    from then on), and may raise to refuse the body there."""
    chunks: list[bytes] = []
    size = 0
    pause = conf.body_seconds()
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        wait, late = pause, None
        if pace is not None:
            due, reason = pace.due(started, size)
            if due - loop.time() < wait:
                wait, late = max(0.0, due - loop.time()), reason
        try:
            async with asyncio.timeout(wait):
                message = await receive()
        except TimeoutError:
            if late is not None:
                raise TooSlow(late) from None
            raise Slow() from None
        if message["type"] == "http.disconnect":
            raise Disconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooBig()
        if charge is not None and chunk:
            charge(len(chunk))
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


# -- streams ------------------------------------------------------------------------------


class Broken(Exception):
    """The source of a stream broke off (after saying so in the stream)."""


async def pump(
    chunks: AsyncIterator[bytes], send: Send, receive: Receive, on_disconnect: Callable[[], None]
) -> str:
    """Send the chunks as they come; when the client hangs up, call `on_disconnect` at once
    (closing the upstream connection, which makes the engine stop) and stop.

    Returns "done", "gone" (the client left) or "broken" (the source broke off)."""
    gone = asyncio.Event()

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                on_disconnect()
                return

    watcher = asyncio.ensure_future(watch())
    outcome = "done"
    try:
        async for chunk in chunks:
            if gone.is_set():
                break
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except Broken:
        outcome = "broken"
    except OSError:
        gone.set()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if gone.is_set():
        return "gone"
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return outcome
