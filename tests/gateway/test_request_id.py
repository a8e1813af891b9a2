"""One request ID: a client's sane X-Request-ID is kept, anything else replaced (never repeated),
and the ID is on every answer of the gateway and the web, in their log lines, in error bodies and
in the request the engine gets."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from core import requestid
from gateway.forwarded import client_address_from_gateway, from_gateway
from llmgw_site.logformat import JSONFormatter, OneLineFormatter
from tests.gateway import rawhttp
from tests.gateway.fake_engine import FakeEngine

NEW = re.compile(r"[0-9a-f]{32}")
SANE = ["abc", "a", "A-b_c.9", "x" * 64, "0b0e2f4c-5a1d-4c8b-9f0e-1d2c3b4a5f6e", "req.1_x-2"]
INSANE = [
    "",
    "x" * 65,
    "a b",
    "a\nb",
    "a\r\nSet-Cookie: x=1",
    "<script>",
    "ab/cd",
    "é",
    "...",
    "---",
    "a;b",
]


# -- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sent", SANE)
def test_a_sane_id_is_kept(sent: str) -> None:
    assert requestid.chosen(sent) == sent
    assert requestid.chosen(sent.encode()) == sent


@pytest.mark.parametrize("sent", INSANE)
def test_anything_else_is_replaced_by_a_new_one(sent: str) -> None:
    chosen = requestid.chosen(sent)
    assert NEW.fullmatch(chosen)
    assert chosen != requestid.chosen(sent)  # new each time


def test_the_check_is_cheap() -> None:
    import timeit

    sent = b"0b0e2f4c-5a1d-4c8b-9f0e-1d2c3b4a5f6e"
    seconds = min(timeit.repeat(lambda: requestid.chosen(sent), number=10_000, repeat=3))
    assert seconds / 10_000 < 5e-6  # about 0.5 µs here


# -- the gateway ------------------------------------------------------------------------------


@pytest.fixture
def lines() -> Iterator[Callable[[], tuple[str, str]]]:
    """The gateway's log lines so far as the processes write them: as text, and as JSON."""
    written, as_json = io.StringIO(), io.StringIO()
    handlers = [logging.StreamHandler(written), logging.StreamHandler(as_json)]
    handlers[0].setFormatter(OneLineFormatter())
    handlers[1].setFormatter(JSONFormatter())
    logger = logging.getLogger("llmgw.gateway")
    for handler in handlers:
        logger.addHandler(handler)
    yield lambda: (written.getvalue(), as_json.getvalue())
    for handler in handlers:
        logger.removeHandler(handler)


def test_a_sane_id_goes_to_the_engine_and_comes_back(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    response = gw.request(
        "POST",
        "/v1/completions",
        json={"model": "chat", "prompt": "a"},
        headers={"X-Request-ID": "client-id.42"},
    )
    assert response.status_code == 200
    assert response.headers["X-Request-ID"] == "client-id.42"
    assert engine.request_ids == ["client-id.42"]
    # A stream too.
    response = gw.request(
        "POST",
        "/v1/completions",
        json={"model": "chat", "prompt": "a", "stream": True},
        headers={"X-Request-ID": "streamed"},
    )
    assert response.status_code == 200 and response.headers["X-Request-ID"] == "streamed"
    assert engine.request_ids[-1] == "streamed"


def test_without_one_each_request_gets_a_new_one(gw: Any, catalog: Any, engine: FakeEngine) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    answers = [gw.post("/v1/completions", {"model": "chat", "prompt": "a"}) for _ in range(2)]
    ids = [a.headers["X-Request-ID"] for a in answers]
    assert all(NEW.fullmatch(i) for i in ids) and ids[0] != ids[1]
    assert engine.request_ids == ids


@pytest.mark.parametrize("sent", ["x" * 65, "a b", "<script>alert(1)</script>", "a,b"])
def test_an_insane_id_is_replaced_everywhere(
    gw: Any, catalog: Any, engine: FakeEngine, sent: str
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    response = gw.request(
        "POST",
        "/v1/completions",
        json={"model": "chat", "prompt": "a"},
        headers={"X-Request-ID": sent},
    )
    assert response.status_code == 200
    chosen = response.headers["X-Request-ID"]
    assert NEW.fullmatch(chosen)
    assert engine.request_ids == [chosen]
    assert sent not in response.text


def test_a_newline_in_the_header_is_replaced() -> None:
    """A header value with a newline in it, as an ASGI server might pass it (no HTTP client
    sends one): replaced, and nothing of it answered."""
    from gateway.asgi import application

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/nothing",
        "headers": [(b"x-request-id", b"abc\nSet-Cookie: x=1")],
    }
    asyncio.run(application(scope, receive, send))
    headers = dict(sent[0]["headers"])
    assert sent[0]["status"] == 404
    chosen = headers[b"x-request-id"].decode()
    assert NEW.fullmatch(chosen)
    assert f'"request_id": "{chosen}"'.encode() in sent[1]["body"]
    assert b"Set-Cookie" not in sent[1]["body"]
    assert requestid.current.get() is None  # nothing left behind in the caller's context


def test_error_bodies_carry_the_id(gw: Any, gateway_server: Any, catalog: Any) -> None:
    headers = {"X-Request-ID": "err-1"}
    refusals = [
        requests.get(f"{gateway_server.url}/v1/models", headers=headers, timeout=10),  # 401
        gw.request("GET", "/v1/nothing", headers=headers),  # 404: no such endpoint
        gw.request(
            "POST", "/v1/completions", json={"model": "nope", "prompt": "a"}, headers=headers
        ),  # 404
        gw.request("GET", "/v1/completions", headers=headers),  # 405
        gw.request("POST", "/v1/completions", data="not json", headers=headers),  # 400
    ]
    assert [r.status_code for r in refusals] == [401, 404, 404, 405, 400]
    for response in refusals:
        assert response.headers["X-Request-ID"] == "err-1"
        error = response.json()["error"]
        assert error["request_id"] == "err-1"
        # Added; the rest of OpenAI's error object as it was.
        assert set(error) == {"message", "type", "param", "code", "request_id"}


def test_a_body_too_large_is_refused_with_the_id(gw: Any, settings: Any, catalog: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    response = gw.request(
        "POST", "/v1/completions", data="x" * 1000, headers={"X-Request-ID": "big-1"}
    )
    assert response.status_code == 413
    assert response.headers["X-Request-ID"] == "big-1"
    assert response.json()["error"]["request_id"] == "big-1"


def test_a_request_refused_before_its_head_is_read_gets_a_new_id(gateway_server: Any) -> None:
    sock = rawhttp.connect(gateway_server.url)
    try:
        sock.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Request-ID: early\r\n" + b"x" * 70000
        )
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    finally:
        sock.close()
    head = received.partition(b"\r\n\r\n")[0].decode()
    assert head.startswith("HTTP/1.1 431")
    [chosen] = re.findall(r"(?im)^x-request-id: (\S+)\r?$", head)
    assert NEW.fullmatch(chosen)


def test_the_gateways_log_lines_about_a_request_name_it(
    gw: Any, catalog: Any, engine: FakeEngine, lines: Callable[[], tuple[str, str]]
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    engine.mode = "error"
    response = gw.request(
        "POST",
        "/v1/completions",
        json={"model": "chat", "prompt": "a"},
        headers={"X-Request-ID": "logged-7"},
    )
    assert response.status_code == 500
    assert response.headers["X-Request-ID"] == "logged-7"
    # The engine's own error body is passed on as it came.
    assert response.json() == {"detail": "the engine fell over"}
    text, as_json = lines()
    [line] = [line for line in text.splitlines() if "answered 500" in line]
    assert line.startswith(tuple("0123456789")) and " WARNING llmgw.gateway: " in line
    assert line.endswith(" request_id=logged-7")
    [record] = [json.loads(line) for line in as_json.splitlines() if "answered 500" in line]
    assert record["request_id"] == "logged-7" and record["level"] == "WARNING"
    assert record["logger"] == "llmgw.gateway"


# -- through the gateway to the web -----------------------------------------------------------


def test_the_web_gets_the_gateways_id_and_it_comes_back_once(
    gateway_server: Any, echo: str, settings: Any
) -> None:
    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    for sent in ("web-1", "bad id", None):
        headers = {"X-Request-ID": sent} if sent else {}
        response = requests.get(f"{gateway_server.url}/console/", headers=headers, timeout=10)
        assert response.status_code == 200
        [answered] = response.raw.headers.getlist("X-Request-ID")  # one, not the web's too
        assert response.json()["headers"]["x-request-id"] == answered
        if sent == "web-1":
            assert answered == "web-1"
        else:
            assert NEW.fullmatch(answered)


def test_a_refusal_of_a_request_for_the_web_carries_the_id(
    gateway_server: Any, settings: Any
) -> None:
    settings.LLMGW_GATEWAY_FORWARD_TO = None
    response = requests.get(
        f"{gateway_server.url}/console/", headers={"X-Request-ID": "no-web"}, timeout=10
    )
    assert response.status_code == 404
    assert response.headers["X-Request-ID"] == "no-web"
    assert response.json()["error"]["request_id"] == "no-web"


# -- the web ----------------------------------------------------------------------------------


SECRET = "s3cret-of-this-start"


def web(environ: dict[str, Any], monkeypatch: Any) -> tuple[list[tuple[str, str]], str, str]:
    """What the web application behind llmgw_site.wsgi's wrappers answers (its headers), the
    ID it saw in its environ, and the line it logged."""
    monkeypatch.setenv("LLMGW_GATEWAY_SECRET", SECRET)
    written = io.StringIO()
    handler = logging.StreamHandler(written)
    handler.setFormatter(OneLineFormatter())
    logger = logging.getLogger("llmgw.test_web")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    seen: list[str] = []

    def app(env: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.append(env["HTTP_X_REQUEST_ID"])
        logger.info("served")
        start_response("200 OK", [("Content-Type", "text/plain"), ("X-Request-ID", "stale")])
        return [b"ok"]

    answered: list[list[tuple[str, str]]] = []
    wrapped = client_address_from_gateway(requestid.wsgi(app, trusted=from_gateway))
    try:
        wrapped({"REMOTE_ADDR": "127.0.0.1", **environ}, lambda s, h, e=None: answered.append(h))
    finally:
        logger.removeHandler(handler)
    assert requestid.current.get() is None
    return answered[0], seen[0], written.getvalue().strip()


def test_the_web_takes_the_gateways_id(monkeypatch: Any) -> None:
    headers, seen, line = web(
        {"HTTP_X_LLMGW_GATEWAY": SECRET, "HTTP_X_REQUEST_ID": "from-gw"}, monkeypatch
    )
    assert [v for k, v in headers if k == "X-Request-ID"] == ["from-gw"]
    assert seen == "from-gw"
    assert line.endswith("INFO llmgw.test_web: served request_id=from-gw")


@pytest.mark.parametrize("secret", [None, "guessed"])
def test_the_web_applies_the_rule_to_anyone_else(monkeypatch: Any, secret: str | None) -> None:
    more = {"HTTP_X_LLMGW_GATEWAY": secret} if secret else {}
    headers, seen, _ = web({"HTTP_X_REQUEST_ID": "sane.one", **more}, monkeypatch)
    assert seen == "sane.one"
    headers, seen, line = web({"HTTP_X_REQUEST_ID": "x" * 100, **more}, monkeypatch)
    [answered] = [v for k, v in headers if k == "X-Request-ID"]
    assert NEW.fullmatch(answered) and seen == answered
    assert line.endswith(f"request_id={answered}")


def test_the_web_makes_one_when_none_is_sent(monkeypatch: Any) -> None:
    headers, seen, _ = web({}, monkeypatch)
    assert [v for k, v in headers if k == "X-Request-ID"] == [seen]
    assert NEW.fullmatch(seen)
