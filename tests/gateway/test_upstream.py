"""The gateway's own HTTP/1.1 client to the engines (gateway.upstream, through gateway.proxy), and
the answer's head written with its body (gateway.protocol.HeadWithBody).

The engine here is a raw asyncio server on 127.0.0.1, so that a test says exactly what goes over
the wire: how many connections, which requests on which, what is answered and when it closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway import proxy, upstream
from gateway.protocol import HeadWithBody
from gateway.routing import Balancer, Candidate, Serve
from gateway.tracing import Tracer
from tests.support.waiting import wait_for_async

WHOLE = b'{"usage": {"prompt_tokens": 2, "completion_tokens": 3}}'


def answer(body: bytes = WHOLE, *, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
        % (len(body), extra)
    ) + body


@dataclass
class Cut:
    data: bytes


@dataclass
class Engine:
    """What the engine does with each request: `script` is called with the request's index
    over all connections and returns the bytes to answer (None: close without a word;
    "silent": say nothing; Cut(bytes): those bytes, then close)."""

    script: Callable[[int], bytes | str | Cut | None]
    port: int = 0
    connections: int = 0
    heads: list[bytes] = field(default_factory=list)
    server: Any = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.heads.append(head)
                reply = self.script(len(self.heads) - 1)
                if reply == "silent":
                    await asyncio.Event().wait()  # never set: says nothing until closed
                if reply is None:
                    break
                if isinstance(reply, Cut):
                    writer.write(reply.data)
                    await writer.drain()
                    break
                assert isinstance(reply, bytes)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def on_engine(
    script: Callable[[int], bytes | str | Cut | None],
    test: Callable[[Engine, proxy.Upstream], Awaitable[Any]],
) -> Any:
    async def main() -> Any:
        engine = Engine(script)
        engine.server = await asyncio.start_server(engine._serve, "127.0.0.1", 0)
        engine.port = engine.server.sockets[0].getsockname()[1]
        pool = proxy.Upstream()
        try:
            return await test(engine, pool)
        finally:
            await pool.close()
            engine.server.close()

    return asyncio.run(main())


def replica(port: int, id: str = "r") -> Candidate:
    return Candidate(id=id, model="m", state="ready", address="127.0.0.1", port=port, key="k")


async def post(pool: proxy.Upstream, port: int, *, stream: bool = False) -> proxy.Answer:
    async def nothing_else() -> tuple[Candidate, ...]:
        return ()

    return await proxy.send(
        Serve(model="m", engine_name="m", candidates=(replica(port),)),
        "/v1/chat/completions",
        b'{"model": "m"}',
        stream=stream,
        balancer=Balancer(),
        upstream=pool,
        refresh=nothing_else,
        tracer=Tracer(),
    )


def test_requests_one_after_another_go_over_one_kept_connection() -> None:
    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        for _ in range(3):
            got = await post(pool, engine.port)
            assert (got.status, got.body) == (200, WHOLE)
        assert engine.connections == 1
        assert len(engine.heads) == 3
        head = engine.heads[0].decode()
        assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n")
        assert f"Host: 127.0.0.1:{engine.port}\r\n" in head
        assert "Authorization: Bearer k\r\n" in head  # the engine's key
        assert "Content-Length: 14\r\n" in head

    on_engine(lambda i: answer(), test)


def test_a_kept_connection_the_engine_dropped_is_replaced_without_the_client_noticing() -> None:
    # The engine closes the kept connection when the second request comes, without answering
    # it (as an engine closing idle connections does at that moment): the request goes again,
    # once, on a new connection to the same engine.
    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        assert (await post(pool, engine.port)).status == 200
        got = await post(pool, engine.port)
        assert (got.status, got.body, got.retried) == (200, WHOLE, False)
        assert engine.connections == 2
        assert len(engine.heads) == 3  # the second request was seen twice

    on_engine(lambda i: None if i == 1 else answer(), test)


def test_a_new_connection_dropped_before_an_answer_is_not_sent_again() -> None:
    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        with pytest.raises(proxy.ReplicaGone, match="closed the connection"):
            await post(pool, engine.port)
        assert len(engine.heads) == 1

    on_engine(lambda i: None, test)


def test_an_answer_cut_off_in_its_body_is_broken_not_retried() -> None:
    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        assert (await post(pool, engine.port)).status == 200
        with pytest.raises(proxy.ReplicaGone):
            await post(pool, engine.port)
        assert len(engine.heads) == 2

    cut = answer()[:-5]
    on_engine(lambda i: answer() if i == 0 else Cut(cut), test)


def test_a_silent_engine_times_out(settings: Any) -> None:
    settings.LLMGW_GATEWAY_UPSTREAM_TIMEOUT = 1

    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        with pytest.raises(proxy.ReplicaTimeout):
            await post(pool, engine.port)

    on_engine(lambda i: "silent", test)


def test_an_answer_larger_than_the_bound_is_refused(monkeypatch: Any) -> None:
    monkeypatch.setattr(upstream, "MAX_ANSWER_BYTES", 1000)

    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        with pytest.raises(proxy.ReplicaGone, match="larger than 1000 bytes"):
            await post(pool, engine.port)

    on_engine(lambda i: answer(b"x" * 5000), test)


def test_a_connection_the_engine_asks_to_close_is_not_kept() -> None:
    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        for _ in range(2):
            assert (await post(pool, engine.port)).status == 200
        assert engine.connections == 2

    on_engine(lambda i: answer(extra=b"Connection: close\r\n"), test)


def test_a_stream_is_read_as_it_comes_and_its_connection_kept_once_whole() -> None:
    events = [b'data: {"n": %d}\n\n' % i for i in range(3)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )

    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        got = await post(pool, engine.port, stream=True)
        assert got.streaming and got.content_type == "text/event-stream"
        read = got.first + await rest(got)
        got.close()
        assert read == b"".join(events)
        assert pool.pool.size() == 1
        again = await post(pool, engine.port)
        assert again.status == 200 and engine.connections == 1

    on_engine(lambda i: head + chunked if i == 0 else answer(), test)


def test_a_stream_the_client_stops_reading_stops_reading_from_the_engine(monkeypatch: Any) -> None:
    # Flow control: past READ_HIGH_BYTES unread, the connection stops reading from the engine;
    # nothing is lost when reading goes on.
    monkeypatch.setattr(upstream, "READ_HIGH_BYTES", 4096)
    piece = b"data: " + b"y" * 1000 + b"\n\n"
    body = piece * 400
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"

    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        got = await post(pool, engine.port, stream=True)
        connection = got.connection
        assert connection is not None

        await wait_for_async(lambda: connection.paused, timeout=10, what="reading paused")
        assert connection.buffered < len(body)
        read = got.first + await rest(got)
        got.close()
        assert read == body

    on_engine(lambda i: head % len(body) + body, test)


def test_a_header_with_a_line_break_is_never_written() -> None:
    with pytest.raises(ValueError, match="line break"):
        upstream.request_head("POST", "h", 1, "/v1", {"Authorization": "Bearer a\r\nX: y"}, 0)
    with pytest.raises(ValueError, match="line break"):  # a request's own, past the kept start
        upstream.request_head("POST", "h", 1, "/v1", {}, 0, {"traceparent": "00-a\nX: y"})


def test_a_head_is_its_line_host_headers_and_length() -> None:
    for _ in range(2):  # the second from the kept start
        head = upstream.request_head(
            "POST", "h", 1, "/v1/x", {"Authorization": "Bearer a"}, 7, {"X-Request-ID": "r1"}
        )
        assert head == (
            b"POST /v1/x HTTP/1.1\r\nHost: h:1\r\nAuthorization: Bearer a\r\n"
            b"X-Request-ID: r1\r\nContent-Length: 7\r\n\r\n"
        )
    assert upstream.request_head("GET", "h", 2, "/", {}, 0) == (
        b"GET / HTTP/1.1\r\nHost: h:2\r\nContent-Length: 0\r\n\r\n"
    )


def test_connections_idle_too_long_are_closed_not_reused(monkeypatch: Any) -> None:
    async def test(engine: Engine, pool: proxy.Upstream) -> None:
        assert (await post(pool, engine.port)).status == 200
        assert pool.pool.size() == 1
        later = upstream.time.monotonic() + upstream.IDLE_SECONDS + 1
        monkeypatch.setattr(upstream.time, "monotonic", lambda: later)
        assert (await post(pool, engine.port)).status == 200
        assert engine.connections == 2

    on_engine(lambda i: answer(), test)


# -- the answer's head and body in one write -------------------------------------------------


class Recorded:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_whole_answer_is_one_write() -> None:
    transport = Recorded()
    wrapped = HeadWithBody(transport)
    wrapped.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert transport.writes == []
    wrapped.write(b"{}")
    wrapped.write(b"more")
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", b"more"]
    assert not wrapped.is_closing()  # the rest is the transport's


def test_100_continue_is_not_held_and_a_head_alone_goes_out_at_close() -> None:
    transport = Recorded()
    wrapped = HeadWithBody(transport)
    wrapped.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    wrapped.write(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
    wrapped.close()
    assert transport.writes[-1] == b"HTTP/1.1 500 Internal Server Error\r\n\r\n"
    assert transport.closed


async def rest(got: proxy.Answer) -> bytes:
    """A streamed answer after its first piece, read as the relay reads it."""
    assert got.connection is not None
    parts = []
    while chunk := await got.connection.read(got.timeout):
        parts.append(chunk)
    return b"".join(parts)
