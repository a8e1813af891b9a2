"""uvicorn's httptools protocol with the limits a public port needs before anything is known
about a client.

    uvicorn gateway.asgi:application --http gateway.protocol:GatewayProtocol …

What uvicorn's own protocol leaves open, and what this one does about it:

- **Header size.** Nothing limits a request's head, and the parser joins the pieces of a long
  header value by concatenating bytes, which costs time quadratic in its length: four clients
  sending 160 MB headers held a worker for tens of seconds. Here a head (request line and
  headers) longer than `max_head_bytes` is answered 431 and the connection closed; the bytes
  of a head are counted before the parser sees them, so at most `max_head_bytes` + 1 of them
  are ever parsed.
- **Header count.** More than `max_headers` headers: 431.
- **Slow heads.** A head must arrive whole within `head_seconds` of the connection (or of the
  end of the previous request on a kept-alive connection, where uvicorn's keep-alive timeout
  covers the wait for its first byte): else 408 and closed. A client trickling one byte a second
  holds a connection for that long at most.
- **Trailers.** A chunked body's trailer fields were appended to the request's headers, after
  the application may have looked at them (an Authorization sent as a trailer was honoured by the
  web process). Trailer fields are dropped here (the gateway and the web use none); their bytes
  count against the head limit, so an endless trailer is cut off like an endless head.
- **Connections.** At most `max_connections` open at once per process; one past it is closed
  before anything is read from it. With the head limit, this bounds what clients not yet known
  can pin: at most max_connections times (max_head_bytes + one 256 KiB read) per process.
- **Odd request lines.** Only origin-form targets (`/path?query`) are served: `OPTIONS *`, an
  absolute URL or an authority is a 400 from here, as is anything the parser rejects.

Every refusal is answered by this protocol itself (no application task is started), with
`connection: close`, and counted by reason in /metrics (llmgw_gateway_refused).
"""

from __future__ import annotations

import asyncio
import functools
import http
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from core import requestid

from . import conf
from .metrics import metrics


@dataclass(frozen=True)
class Limits:
    max_head_bytes: int
    max_headers: int
    head_seconds: float
    max_connections: int


@functools.cache
def limits() -> Limits:
    """Read once per process, at its first connection (a bad value stops the gateway at start:
    gateway.process.Gateway.started reads them too)."""
    return Limits(
        max_head_bytes=conf.max_head_bytes(),
        max_headers=conf.max_headers(),
        head_seconds=conf.head_seconds(),
        max_connections=conf.max_connections(),
    )


class _TooManyHeaders(Exception):
    pass


class GatewayProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits()
        # Bytes of the current head seen so far; None between a head's end and the next
        # message's beginning (while its body is read and while the response is sent).
        self._head_bytes: int | None = 0
        self._header_count = 0
        self._trailer_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None

    # -- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections:
            metrics().refused.labels("too_many_connections").inc()
            transport.close()
            return
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        if self._head_bytes is not None:
            # Feed no more of a head than the limit allows (plus one byte, to know it is over).
            room = self._limits.max_head_bytes + 1 - self._head_bytes
            if len(data) > room:
                if not self._feed(data[:room]):
                    return
                if self._head_bytes is not None:
                    self._refuse(431, "head_too_large", self._head_too_large())
                    return
                data = data[room:]
            else:
                self._head_bytes += len(data)
        self._feed(data)
        if self._head_bytes is not None and self._head_bytes > self._limits.max_head_bytes:
            self._refuse(431, "head_too_large", self._head_too_large())

    def _feed(self, data: bytes) -> bool:
        """Give the parser `data`; False when that ended the connection."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _TooManyHeaders):
                self._refuse(
                    431,
                    "too_many_headers",
                    f"The request has more than {self._limits.max_headers} header fields.",
                )
            elif isinstance(exc.__context__, _OddTarget):
                self._refuse(400, "odd_request_line", str(exc.__context__))
            else:
                self._refuse(400, "bad_request", "The request is not valid HTTP/1.1.")
            return False
        except httptools.HttpParserUpgrade:
            # Neither the gateway nor the web upgrades (uvicorn runs with --ws none): the
            # request was dispatched as a plain one, as uvicorn's own protocol does.
            pass
        except httptools.HttpParserError:
            self._refuse(400, "bad_request", "The request is not valid HTTP/1.1.")
            return False
        return not self.transport.is_closing()

    def _head_too_large(self) -> str:
        return (
            f"The request's line and header fields are longer than "
            f"{self._limits.max_head_bytes} bytes."
        )

    # -- the parser's callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_bytes is None:
            self._head_bytes = 0
        self._header_count = 0
        self._trailer_bytes = 0
        if self._head_timer is None:  # counted from the connection for its first request
            self._start_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_bytes is None:
            # A trailer field: dropped, but its bytes count like a head's.
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > self._limits.max_head_bytes:
                raise _TooManyHeaders()
            return
        self._header_count += 1
        if self._header_count > self._limits.max_headers:
            raise _TooManyHeaders()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() not in ("1.1", "1.0"):
            raise _OddTarget("This server speaks HTTP/1.1 (and 1.0): name the version.")
        if not self.url.startswith(b"/"):
            raise _OddTarget(
                "The request target must be a path beginning with '/' "
                f"(this server is no proxy and answers no {self.parser.get_method().decode()!s} *)."
            )
        self._head_bytes = None
        self._stop_head_timer()
        super().on_headers_complete()

    # -- refusing -----------------------------------------------------------------------------

    def _refuse(self, status: int, reason: str, message: str) -> None:
        metrics().refused.labels(reason).inc()
        self._stop_head_timer()
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request while the one before it is answered: no room for an answer.
            self.transport.close()
            return
        body = message.encode("ascii", "replace")
        phrase = http.HTTPStatus(status).phrase.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"x-request-id: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            # A request refused before its head was read has no ID of its own: a new one.
            % (status, phrase, requestid.new().encode(), len(body), body)
        )
        self.transport.close()

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self._limits.head_seconds, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_bytes is None or self.transport.is_closing():
            return
        self._refuse(
            408,
            "head_timeout",
            f"The request's head did not arrive within {self._limits.head_seconds:g} seconds.",
        )


class _OddTarget(Exception):
    pass
