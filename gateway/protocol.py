"""uvicorn's httptools protocol with the limits a public port needs before anything is known
about a client.

    uvicorn gateway.asgi:application --http gateway.protocol:GatewayProtocol …

It bounds a request's head (bytes, fields, time) and the connections open at once, serves only
plain request targets, answers a broken chunked body, and drops trailer fields and a trusted
proxy's X-Forwarded-For that names no address (`GatewayProtocol` says how, and why). The limits
for operators: docs/security.md#the-public-port-before-a-client-is-known.
"""

from __future__ import annotations

import asyncio
import functools
import http
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from core import requestid

from . import conf
from .metrics import metrics

log = logging.getLogger("llmgw.gateway")


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


class HeadWithBody:
    """A request's transport as uvicorn's answer writes to it: the status line and headers,
    which it writes at http.response.start, are held back and go out in one write with the
    body's first piece (a whole answer: all of it). A write to a loopback socket costs as much
    as the rest of a small request's answer in Python (bench/gateway_profile.py): one, not two.

    Only the answer's head is held: "100 Continue" passes at once, and anything after the
    first piece of the body. A HEAD request's answer has no body, so it is not wrapped.
    """

    __slots__ = ("_head", "_passing", "_transport")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._passing = False

    def write(self, data: bytes) -> None:
        if self._passing:
            self._transport.write(data)
        elif self._head is not None:
            self._passing = True
            self._transport.write(self._head + data)
            self._head = None
        elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
            self._head = data
        else:
            self._transport.write(data)

    def close(self) -> None:
        if self._head is not None:
            self.write(b"")
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayCycle(RequestResponseCycle):
    """uvicorn's cycle of one request and its answer, with a shorter way for what every answer
    sends (the gateway writes a stream's every event through here: 20 a second per stream, 10,000
    a second at 512 streams), and the same bytes on the wire:

    - the status line and headers: the names are checked for forbidden bytes in one search over
      all of them, and so are the values (both patterns are single-byte classes, so one search
      over the joined parts finds what one a part would), instead of two searches a header;
    - a piece of a chunked body that more follow: framed and written, without the checks that
      apply to a first, last or HEAD answer's piece (those go through uvicorn's own send).

    GatewayProtocol makes every request's cycle one of these (uvicorn builds the cycle; its
    class is swapped before the application runs: it adds no state of its own)."""

    async def send(self, message: Any) -> None:
        if self.flow.write_paused or self.disconnected:
            await super().send(message)
        elif not self.response_started:
            if message["type"] == "http.response.start" and not self.access_log:
                self._start(message)
            else:
                await super().send(message)
        elif (
            self.chunked_encoding
            and not self.response_complete
            and message.get("more_body", False)
            and message["type"] == "http.response.body"
            and self.scope["method"] != "HEAD"  # no body, even one an answer says is chunked
        ):
            body = message.get("body", b"")
            if body:
                self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        else:
            await super().send(message)

    def _start(self, message: Any) -> None:
        """uvicorn's http.response.start, with the header checks done once for all headers."""
        self.response_started = True
        self.waiting_for_100_continue = False
        status = message["status"]
        headers = self.default_headers + list(message.get("headers", []))
        if HEADER_RE.search(b"".join(name for name, _ in headers)):
            raise RuntimeError("Invalid HTTP header name.")
        if HEADER_VALUE_RE.search(b"".join(value for _, value in headers)):
            raise RuntimeError("Invalid HTTP header value.")
        content = [STATUS_LINE[status]]
        closes = False
        for name, value in headers:
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in [
                token.lower().strip() for token in value.split(b",")
            ]:
                self.keep_alive = False
                closes = True
            content.extend((name, b": ", value, b"\r\n"))
        if not self.keep_alive and not closes:
            content.append(b"connection: close\r\n")
        if (
            self.chunked_encoding is None
            and self.scope["method"] != "HEAD"
            and status not in (204, 304)
        ):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self.transport.write(b"".join(content))


class _TooManyHeaders(Exception):
    pass


class _HeadTooLarge(Exception):
    pass


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's HttpToolsProtocol with the public port's limits. What uvicorn's own leaves
    open, and what this one does about it:

    - Head size. Nothing limits a request's head, and the parser joins the pieces of a long
      header value by concatenating bytes, in time quadratic in its length: four clients
      sending 160 MB headers held a worker for tens of seconds. Here a head (request line and
      headers) longer than max_head_bytes is answered 431 and the connection closed. Its bytes
      are counted before the parser sees them, so at most max_head_bytes + 1 are ever parsed,
      and again as the parser reads them (its target and fields): several pipelined requests
      arrive in one read, and only the first head of a read can be counted before it is parsed.
    - Header count. More than max_headers headers: 431.
    - Slow heads. A head must arrive whole within head_seconds of the connection (or of the end
      of the previous request on a kept-alive connection, where uvicorn's keep-alive timeout
      covers the wait for its first byte): else 408 and closed.
    - Pipelined requests. A request refused while the one before it is still being answered
      gets its refusal after that answer, then the connection is closed.
    - Trailers. uvicorn appends a chunked body's trailer fields to the request's headers, after
      the application may have looked at them (an Authorization sent as a trailer would be
      honoured by the web). They are dropped (the gateway and the web use none); their bytes
      count against the head limit, so an endless trailer is cut off like an endless head.
    - Connections. One past max_connections per process is closed before anything is read from
      it. With the head limit, clients not yet known can pin at most max_connections x
      (max_head_bytes + one 256 KiB read) per process.
    - Odd request lines. Only origin-form targets (`/path?query`) on HTTP/1.0 or 1.1 are
      served: `OPTIONS *`, an absolute URL or an authority is a 400, as is anything the parser
      rejects.
    - Broken chunked bodies. uvicorn closes the connection without a word; here the request is
      answered 400 (its application is told the client went away), then the connection closed.
    - A trusted proxy's X-Forwarded-For (uvicorn's --forwarded-allow-ips) that names no address
      where the client's should be (`unknown`, `<svg …>`) is dropped before uvicorn reads it,
      so the proxy's own address is the client's; logged once a process, counted in
      llmgw_gateway_forwarded_for_ignored.

    Every refusal is answered by this protocol itself (no application task is started, but for
    a broken body's request), with `connection: close`, and counted by reason in /metrics
    (llmgw_gateway_refused).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits()
        # Bytes of the current head seen so far; None between a head's end and the next
        # message's beginning (while its body is read and while the response is sent).
        self._head_bytes: int | None = 0
        # Bytes of the current message's target and header fields as the parser gives them.
        self._parsed_head = 0
        self._header_count = 0
        self._trailer_bytes = 0
        self._in_body = False  # from a head's end to its message's end
        self._heads = 0  # heads whose count began from 0 after a message (see data_received)
        self._head_timer: asyncio.TimerHandle | None = None
        # A refusal waiting for the answer before it (a pipelined request): status, message.
        self._refusal: tuple[int, str] | None = None

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
        if self.transport.is_closing() or self._refusal is not None:
            return
        self._unset_keepalive_if_required()
        while data:
            if self._head_bytes is None:
                # A body, or what follows a message: fed whole, the next head in it counted
                # as the parser reads it (_count_parsed).
                self._feed(data)
                return
            # Feed no more of a head than the limit allows (plus one byte, to know it is over).
            room = self._limits.max_head_bytes + 1 - self._head_bytes
            piece, data = data[:room], data[room:]
            heads = self._heads
            self._head_bytes += len(piece)
            if not self._feed(piece):
                return
            if (
                self._heads == heads
                and self._head_bytes is not None
                and self._head_bytes > self._limits.max_head_bytes
            ):
                self._refuse(431, "head_too_large", self._head_too_large())
                return

    def _feed(self, data: bytes) -> bool:
        """Give the parser `data`; False when that ended the connection."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._refuse(431, "head_too_large", self._head_too_large())
            elif isinstance(exc.__context__, _TooManyHeaders):
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
            if self._in_body:
                self._refuse(
                    400,
                    "bad_chunked_body",
                    "The request body's chunked encoding is broken: each chunk is its size in "
                    "hexadecimal, CRLF, that many bytes and CRLF, and a chunk of size 0 ends it.",
                )
            else:
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
            self._heads += 1
        self._parsed_head = 0
        self._header_count = 0
        self._trailer_bytes = 0
        self._in_body = False
        if self._head_timer is None:  # counted from the connection for its first request
            self._start_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_parsed(len(url))
        super().on_url(url)

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
        self._count_parsed(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_parsed(self, size: int) -> None:
        self._parsed_head += size
        if self._parsed_head > self._limits.max_head_bytes:
            raise _HeadTooLarge()

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() not in ("1.1", "1.0"):
            raise _OddTarget("This server speaks HTTP/1.1 (and 1.0): name the version.")
        if not self.url.startswith(b"/"):
            raise _OddTarget(
                "The request target must be a path beginning with '/' "
                f"(this server is no proxy and answers no {self.parser.get_method().decode()!s} *)."
            )
        self._head_bytes = None
        self._in_body = True
        self._stop_head_timer()
        if self.config.proxy_headers and self.client is not None:
            _drop_forwarded_for_without_address(
                self.headers, self.client[0], self.config.forwarded_allow_ips
            )
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:
            cycle.__class__ = GatewayCycle
            if self.scope["method"] != "HEAD":
                cycle.transport = HeadWithBody(cycle.transport)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._refusal is None or self.pipeline or self.transport.is_closing():
            super().on_response_complete()
            return
        # The answer before a refused pipelined request is out: now its refusal.
        self.server_state.total_requests += 1
        self._answer(*self._refusal)

    # -- refusing -----------------------------------------------------------------------------

    def _refuse(self, status: int, reason: str, message: str) -> None:
        metrics().refused.labels(reason).inc()
        self._stop_head_timer()
        if self.transport.is_closing() or self._refusal is not None:
            return
        cycle = self.cycle
        # A pipelined request while the one before it is answered: its refusal comes after.
        waits = bool(self.pipeline) or (cycle is not None and not cycle.response_complete)
        if self._in_body and cycle is not None and not cycle.response_complete:
            # The refusal answers the request whose body this is.
            queued = next((entry for entry in self.pipeline if entry[0] is cycle), None)
            if queued is not None:
                self.pipeline.remove(queued)  # never started; those before it are answered first
            elif cycle.response_started:
                self.transport.close()  # its answer has begun: no room for this one
                return
            else:
                # Its application waits for the rest of the body: it is told the client went.
                cycle.disconnected = True
                cycle.message_event.set()
                waits = False
        if waits:
            self._refusal = (status, message)
            return
        self._answer(status, message)

    def _answer(self, status: int, message: str) -> None:
        """Write a refusal of this protocol's own and close the connection."""
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


# -- a trusted proxy's word on the client ---------------------------------------------------


class _ProxyWord:
    """Whom uvicorn believes on the client's address (its --forwarded-allow-ips), read as it
    reads them, to find the address it would take from an X-Forwarded-For."""

    def __init__(self, allowed: str) -> None:
        items = [item.strip() for item in allowed.split(",") if item.strip()]
        self.everyone = "*" in items
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.literals: set[str] = set()
        for item in items:
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                self.literals.add(item)
        self.warned = False

    def trusts(self, host: str) -> bool:
        if self.everyone:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host in self.literals
        return any(address in network for network in self.networks)

    def client(self, forwarded_for: str) -> str:
        """The entry uvicorn takes for the client: the last one no trusted proxy wrote (the
        first when every one is trusted), its port left off."""
        entries = [entry.strip() for entry in forwarded_for.split(",")]
        if not self.everyone:
            for entry in reversed(entries):
                host = _host_of(entry)
                if not self.trusts(host):
                    return host
        return _host_of(entries[0])


def _host_of(entry: str) -> str:
    """`entry` less a port: `[2001:db8::1]:80` and `192.0.2.1:80` as uvicorn reads them."""
    if entry.startswith("["):
        end = entry.find("]")
        return entry[1:end] if end != -1 else entry
    if entry.count(":") == 1:
        return entry.rsplit(":", 1)[0]
    return entry


@functools.cache
def _proxy_word(allowed: str) -> _ProxyWord:
    return _ProxyWord(allowed)


def _drop_forwarded_for_without_address(
    headers: list[tuple[bytes, bytes]], peer: str, allowed: str | list[str]
) -> None:
    """Drop the X-Forwarded-For fields of a request from a trusted proxy when the client they
    name is no address: uvicorn would take `not-an-ip` or `<svg …>` as the client's address, to
    be passed to the web, its logs and its throttles. Without them the peer is the client."""
    values = [value for name, value in headers if name == b"x-forwarded-for"]
    if not values:
        return
    word = _proxy_word(allowed if isinstance(allowed, str) else ",".join(allowed))
    if not word.trusts(peer):
        return
    named = word.client(b", ".join(values).decode("latin-1"))
    if not named:
        return  # uvicorn keeps the peer
    try:
        ipaddress.ip_address(named)
        return
    except ValueError:
        pass
    headers[:] = [(name, value) for name, value in headers if name != b"x-forwarded-for"]
    metrics().forwarded_for_ignored.inc()
    if not word.warned:
        word.warned = True
        log.warning(
            "gateway: the trusted proxy %s named the client %r in X-Forwarded-For, which is no "
            "address; its own address is taken instead (logged once a process; counted in "
            "llmgw_gateway_forwarded_for_ignored)",
            peer,
            named[:100],
        )
