"""The public port before anything is known about a client: heads, request lines and bodies
are bounded (gateway.protocol, gateway.asgi), and every refusal is a 4xx, never a 500."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway import protocol
from tests.gateway.rawhttp import closed, connect, exchange, read_answer
from tests.support.waiting import wait_for


@pytest.fixture
def limits(settings: Any) -> Iterator[Any]:
    """Set the protocol's limits for one test (they are read once per process)."""

    def set_limits(**values: Any) -> None:
        for name, value in values.items():
            setattr(settings, name, value)
        protocol.limits.cache_clear()

    protocol.limits.cache_clear()
    yield set_limits
    protocol.limits.cache_clear()


def test_a_head_past_the_limit_is_a_431(gateway_server: Any, limits: Any) -> None:
    limits(LLMGW_GATEWAY_MAX_HEAD_BYTES=4096)
    status, body = exchange(
        gateway_server.url,
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n",
    )
    assert status == 431
    assert b"longer than 4096 bytes" in body
    # Just under the limit is served as usual.
    status, _ = exchange(
        gateway_server.url,
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 3000 + b"\r\n\r\n",
    )
    assert status == 401


def test_headers_without_end_are_cut_off(gateway_server: Any, limits: Any) -> None:
    """A client that sends a header value forever is answered 431 and closed once the limit is
    passed, not when it stops (a 160 MB header held a worker for tens of seconds)."""
    limits(LLMGW_GATEWAY_MAX_HEAD_BYTES=32 * 1024)
    sent = 0
    with connect(gateway_server.url, timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        try:
            while sent < 64 * 1024 * 1024:
                sock.sendall(b"a" * 8192)
                sent += 8192
        except (BrokenPipeError, ConnectionResetError):
            pass
        else:
            pytest.fail("64 MB of one header were taken")
    # What the kernel's buffers held before the close reached the client, beyond the limit.
    assert sent < 16 * 1024 * 1024


def test_the_answer_to_an_endless_head_says_why(gateway_server: Any, limits: Any) -> None:
    limits(LLMGW_GATEWAY_MAX_HEAD_BYTES=2048)
    with connect(gateway_server.url) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nX-Endless: " + b"a" * 4096)
        status, body = read_answer(sock)
    assert status == 431
    assert b"2048 bytes" in body


def test_too_many_header_fields_are_a_431(gateway_server: Any, limits: Any) -> None:
    limits(LLMGW_GATEWAY_MAX_HEADERS=20)
    fields = b"".join(b"X-H%d: 1\r\n" % i for i in range(21))
    status, body = exchange(gateway_server.url, b"GET /v1/models HTTP/1.1\r\n" + fields + b"\r\n")
    assert status == 431
    assert b"more than 20 header fields" in body
    fields = b"".join(b"X-H%d: 1\r\n" % i for i in range(20))
    status, _ = exchange(gateway_server.url, b"GET /v1/models HTTP/1.1\r\n" + fields + b"\r\n")
    assert status == 401


def test_a_head_that_trickles_in_is_cut_off(gateway_server: Any, limits: Any) -> None:
    limits(LLMGW_GATEWAY_HEAD_TIMEOUT=0.5)
    with connect(gateway_server.url, timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        started = time.monotonic()
        status, body = read_answer(sock)
        waited = time.monotonic() - started
    assert status == 408
    assert b"0.5 seconds" in body
    assert waited < 4


def test_a_connection_that_sends_nothing_is_closed(gateway_server: Any, limits: Any) -> None:
    limits(LLMGW_GATEWAY_HEAD_TIMEOUT=0.5)
    with connect(gateway_server.url, timeout=5) as sock:
        assert closed(sock)


def test_connections_past_the_limit_are_closed_unread(gateway_server: Any, limits: Any) -> None:
    limits(LLMGW_GATEWAY_MAX_CONNECTIONS=16)
    held = [connect(gateway_server.url) for _ in range(16)]
    try:
        for sock in held[:1]:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_answer(sock)[0] == 401
        extra = connect(gateway_server.url, timeout=5)
        with extra:
            assert closed(extra)
    finally:
        for sock in held:
            sock.close()
    connections = gateway_server.server.server_state.connections
    wait_for(
        lambda: len(connections) < 16,
        timeout=10,
        what="the server to notice the closes (room under its 16 connections)",
    )
    status, _ = exchange(gateway_server.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 401


def test_a_kept_alive_connection_serves_request_after_request(gateway_server: Any) -> None:
    with connect(gateway_server.url) as sock:
        for _ in range(3):
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            status, body = read_answer(sock)
            assert status == 401
            assert json.loads(body)["error"]["code"] == "missing_api_key"


@pytest.mark.parametrize(
    "request_line",
    [
        b"OPTIONS * HTTP/1.1",
        b"GET http://example.com/v1/models HTTP/1.1",
        b"CONNECT example.com:443 HTTP/1.1",
        b"GET v1/models HTTP/1.1",
        b"GET /v1/\xff HTTP/1.1",
        b"GET /v1/models HTTP/9.9",
        b"GET /v1/models",
        b"HELLO",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello on the plain port
    ],
)
def test_an_odd_request_line_is_a_400(
    gateway_server: Any, settings: Any, request_line: bytes
) -> None:
    settings.LLMGW_GATEWAY_FORWARD_TO = "http://127.0.0.1:9"  # never reached
    status, _ = exchange(gateway_server.url, request_line + b"\r\nHost: x\r\n\r\n")
    assert status == 400


def test_a_bad_header_line_is_a_400(gateway_server: Any) -> None:
    status, _ = exchange(gateway_server.url, b"GET /v1/models HTTP/1.1\r\nno colon here\r\n\r\n")
    assert status == 400


def test_a_body_that_stops_arriving_is_a_408(
    gw: Any, keys: dict[str, str], catalog: Any, limits: Any
) -> None:
    limits(LLMGW_GATEWAY_BODY_TIMEOUT=0.5)
    gw.get("/v1/models")  # the state read once, so the key is known
    with connect(gw.url, timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
            b"Authorization: Bearer " + keys["alice"].encode() + b'\r\n\r\n{"model": '
        )
        status, body = read_answer(sock)
    assert status == 408
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_an_unknown_name_is_echoed_cut_short(gw: Any, catalog: Any) -> None:
    catalog.add("chat-small")
    name = "m" * 1_000_000
    response = gw.post(
        "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert len(response.content) < 2000
    assert "(1000000 characters)" in message
    assert "chat-small" in message


def test_a_raw_socket_flood_of_odd_requests_gets_no_5xx(gateway_server: Any) -> None:
    """Junk after pipelined requests on one connection: the connection may be closed at once,
    and each answer, if any, is a 4xx."""
    with connect(gateway_server.url, timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n\r\n" * 3 + b"OPTIONS * HTTP/1.1\r\n\r\n")
        answers = []
        pending = bytearray()  # the answers may come in one read: the next one's start is kept
        while True:
            try:
                status, _ = read_answer(sock, pending=pending)
            except (TimeoutError, ConnectionResetError):
                break
            if status == 0:
                break
            answers.append(status)
    assert all(400 <= status < 500 for status in answers), answers


def test_pipelined_requests_are_answered_in_turn(gateway_server: Any) -> None:
    with connect(gateway_server.url, timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        received = b""
        while received.count(b"HTTP/1.1 ") < 3:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    assert received.count(b"HTTP/1.1 401 ") == 3


def answers(sock: Any) -> list[tuple[int, bytes]]:
    """Every answer on `sock` until the server closes it (each with a content-length)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    got = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in lines
            if line.lower().startswith(b"content-length:")
        )
        got.append((int(lines[0].split()[1]), rest[:length]))
        received = rest[length:]
    return got


@pytest.mark.parametrize("split", [False, True], ids=["in one piece", "in two pieces"])
def test_a_pipelined_head_past_the_limit_is_a_431(gateway_server: Any, split: bool) -> None:
    """A head behind another request on the connection counts against the limit as the first
    one does (60 kB passed the 32 KiB limit), and is answered 431 after the one before it."""
    first = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    second = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 60_000 + b"\r\n\r\n"
    with connect(gateway_server.url, timeout=5) as sock:
        if split:
            # Each read then holds less than the limit: the second head is counted as parsed.
            sock.sendall(first + second[:30_000])
            sock.sendall(second[30_000:])
        else:
            sock.sendall(first + second)
        got = answers(sock)
    assert [status for status, _ in got] == [401, 431]
    assert b"longer than 32768 bytes" in got[1][1]


def test_pipelined_heads_each_under_the_limit_are_served(gateway_server: Any) -> None:
    one = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    with connect(gateway_server.url, timeout=5) as sock:
        sock.sendall(one * 3 + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = answers(sock)
    assert [status for status, _ in got] == [401, 401, 401, 401]


@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param(b"zz\r\nabc\r\n", id="a size that is not hexadecimal"),
        pytest.param(b"3\r\nabcdef\r\n0\r\n\r\n", id="a chunk longer than its size"),
    ],
)
def test_a_broken_chunked_body_is_a_400(
    gateway_server: Any, echo: str, settings: Any, chunks: bytes
) -> None:
    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    with connect(gateway_server.url, timeout=5) as sock:
        sock.sendall(
            b"POST /login/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks
        )
        got = answers(sock)
    assert [status for status, _ in got] == [400]
    assert b"chunked encoding is broken" in got[0][1]


def test_a_broken_chunked_body_behind_another_request_is_a_400_after_its_answer(
    gateway_server: Any, echo: str, settings: Any
) -> None:
    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    with connect(gateway_server.url, timeout=5) as sock:
        sock.sendall(
            b"GET /login/ HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /login/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
        )
        got = answers(sock)
    assert [status for status, _ in got] == [200, 400]


# -- the answer's bytes: GatewayCycle against uvicorn's own cycle ----------------------------


class _Written:
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _cycle(kind: type, method: str) -> tuple[Any, _Written]:
    import asyncio
    import logging

    from uvicorn.protocols.http.flow_control import FlowControl

    transport = _Written()
    cycle = kind(
        scope={"type": "http", "method": method, "http_version": "1.1", "path": "/"},
        transport=transport,
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=[(b"date", b"Mon, 07 Dec 2026 00:00:00 GMT")],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=True,
        on_response=lambda: None,
    )
    return cycle, transport


def _start(status: int, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http.response.start", "status": status, "headers": list(headers)}


def _body(body: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": body, "more_body": more}


JSON_TYPE = (b"content-type", b"application/json")
ANSWERS = {
    "whole": ("POST", [_start(200, JSON_TYPE, (b"Content-Length", b"2")), _body(b"{}")]),
    "stream": (
        "POST",
        [
            _start(200, JSON_TYPE),
            _body(b"data: 1\n\n", True),
            _body(b"", True),
            _body(b"data: 2\n\n", True),
            _body(b""),
        ],
    ),
    "close": (
        "POST",
        [_start(200, (b"connection", b"Keep-Alive, Close")), _body(b"x", True), _body(b"")],
    ),
    "head": (
        "HEAD",
        [_start(200, (b"transfer-encoding", b"chunked")), _body(b"hidden", True), _body(b"")],
    ),
    "no content": ("POST", [_start(204), _body(b"")]),
    "bad value": ("POST", [_start(200, (b"x-a", b"one\r\ntwo"))]),
    "bad name": ("POST", [_start(200, (b"x a", b"one"))]),
}


@pytest.mark.parametrize("answer", list(ANSWERS))
def test_the_cycle_writes_what_uvicorns_writes(answer: str) -> None:
    import asyncio

    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    method, messages = ANSWERS[answer]

    async def run(kind: type) -> tuple[bytes, str, bool, bool]:
        cycle, transport = _cycle(kind, method)
        failed = ""
        for message in messages:
            try:
                await cycle.send(message)
            except RuntimeError as exc:
                failed = str(exc)
                break
        return transport.data, failed, cycle.keep_alive, cycle.response_complete

    ours = asyncio.run(run(protocol.GatewayCycle))
    assert ours == asyncio.run(run(RequestResponseCycle))
    assert ours[0] or ours[1]  # something was written, or refused
