"""The web process behind the gateway takes the client's address from the gateway alone, and the
gateway passes on no client's word on who it is."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from gateway.forwarded import client_address_from_gateway
from tests.gateway.rawhttp import connect, read_answer
from tests.support.waiting import wait_for

SECRET = "s3cret-of-this-start"


def seen(environ: dict[str, Any], monkeypatch: Any, *, secret: str = SECRET) -> dict[str, Any]:
    """The environ the web application gets behind client_address_from_gateway."""
    monkeypatch.setenv("LLMGW_GATEWAY_SECRET", secret)
    got: list[dict[str, Any]] = []

    def app(env: dict[str, Any], start_response: Any) -> list[bytes]:
        got.append(dict(env))
        return []

    client_address_from_gateway(app)(environ, None)
    return got[0]


def from_gateway(forwarded_for: str, **more: str) -> dict[str, Any]:
    return {
        "REMOTE_ADDR": "127.0.0.1",
        "HTTP_X_FORWARDED_FOR": forwarded_for,
        "HTTP_X_LLMGW_GATEWAY": SECRET,
        **more,
    }


def test_it_takes_the_address_the_gateway_set(monkeypatch: Any) -> None:
    assert seen(from_gateway("203.0.113.7"), monkeypatch)["REMOTE_ADDR"] == "203.0.113.7"


def test_it_takes_the_last_address_when_there_are_several(monkeypatch: Any) -> None:
    environ = from_gateway("10.0.0.1, 203.0.113.7")
    assert seen(environ, monkeypatch)["REMOTE_ADDR"] == "203.0.113.7"


def test_the_gateway_secret_never_reaches_the_application(monkeypatch: Any) -> None:
    environ = seen(from_gateway("203.0.113.7"), monkeypatch)
    assert "HTTP_X_LLMGW_GATEWAY" not in environ
    assert "HTTP_X_FORWARDED_FOR" not in environ


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(None, id="no secret: another local account on 127.0.0.1"),
        pytest.param("guessed", id="a wrong secret"),
    ],
)
def test_without_the_gateway_secret_the_address_is_the_peer(monkeypatch: Any, sent: Any) -> None:
    environ = {"REMOTE_ADDR": "127.0.0.1", "HTTP_X_FORWARDED_FOR": "203.0.113.7"}
    if sent is not None:
        environ["HTTP_X_LLMGW_GATEWAY"] = sent
    assert seen(environ, monkeypatch)["REMOTE_ADDR"] == "127.0.0.1"


def test_with_no_secret_set_no_address_is_believed(monkeypatch: Any) -> None:
    environ = {"REMOTE_ADDR": "127.0.0.1", "HTTP_X_FORWARDED_FOR": "203.0.113.7"}
    assert seen(environ, monkeypatch, secret="")["REMOTE_ADDR"] == "127.0.0.1"


def test_the_gateway_forwards_the_rest_and_says_who_asked(
    gateway_server: Any, echo: str, settings: Any
) -> None:
    import requests

    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    response = requests.get(
        f"{gateway_server.url}/console/models?x=%2F1",
        headers={"X-Forwarded-For": "6.6.6.6", "Host": "llmgw.example"},
        timeout=10,
    )
    assert response.status_code == 200
    got = response.json()
    assert got["path"] == "/console/models?x=%2F1"
    # The client's own claim is replaced by the address the gateway saw.
    assert got["headers"]["x-forwarded-for"] == "127.0.0.1"
    assert got["headers"]["host"] == "llmgw.example"
    assert response.raw.headers.getlist("Set-Cookie") == ["a=1", "b=2"]


def test_no_client_header_says_who_the_client_is(
    gateway_server: Any, echo: str, settings: Any, monkeypatch: Any
) -> None:
    import requests

    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    monkeypatch.setenv("LLMGW_GATEWAY_SECRET", SECRET)
    spoofed = {
        "X-Forwarded-For": "6.6.6.6",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Host": "evil.example",
        "X-Forwarded-Port": "443",
        "X-Forwarded-Ssl": "on",
        "X-Forwarded-Protocol": "ssl",
        "X-Forwarded-Prefix": "/evil",
        "Forwarded": "for=6.6.6.6;proto=https",
        "X-Real-IP": "6.6.6.6",
        "True-Client-IP": "6.6.6.6",
        "SCRIPT_NAME": "/evil",
        "X_Forwarded_For": "6.6.6.6",
        "X-LLMGW-Gateway": "guessed",
        "Expect": "100-continue",
    }
    response = requests.post(
        f"{gateway_server.url}/login/", data=b"x" * 10, headers=spoofed, timeout=10
    )
    assert response.status_code == 200
    got = response.json()["headers"]
    client_said = {name.lower() for name in spoofed}
    told = {name for name in got if name in client_said}
    assert told == {"x-forwarded-for", "x-forwarded-proto", "x-llmgw-gateway"}
    assert got["x-forwarded-for"] == "127.0.0.1"
    assert got["x-forwarded-proto"] == "http"
    assert got["x-llmgw-gateway"] == SECRET
    assert response.json()["body_bytes"] == 10


def test_a_trailer_does_not_become_a_header(gateway_server: Any, echo: str, settings: Any) -> None:
    """An Authorization sent only as a chunked body's trailer was honoured by the web."""
    from tests.gateway.rawhttp import exchange

    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    status, body = exchange(
        gateway_server.url,
        b"POST /api/v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\nAuthorization: Token stolen\r\nX-Extra: 1\r\n\r\n",
    )
    assert status == 200, body
    got = json.loads(body)
    assert "authorization" not in got["headers"]
    assert "x-extra" not in got["headers"]
    assert got["body_bytes"] == 3


def test_a_forwarded_body_is_bounded_by_what_the_web_takes(
    gateway_server: Any, echo: str, settings: Any
) -> None:
    import requests

    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 64 * 1024
    response = requests.post(
        f"{gateway_server.url}/login/", data=b"x" * (64 * 1024 + 1), timeout=10
    )
    assert response.status_code == 413
    assert "65,536 bytes" in response.json()["error"]["message"]

    def endless() -> Any:
        for _ in range(100):
            yield b"y" * 1024

    response = requests.post(f"{gateway_server.url}/login/", data=endless(), timeout=10)
    assert response.status_code == 413
    response = requests.post(f"{gateway_server.url}/login/", data=b"x" * 1000, timeout=10)
    assert response.json()["body_bytes"] == 1000


def post_head(url: str, length: int, path: str = "/login/") -> socket.socket:
    """A connection whose request declares a body of `length` bytes, none of it sent yet."""
    sock = connect(url)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
    return sock


def test_a_body_holds_the_bytes_it_sent_not_those_it_declares(
    gateway_server: Any, echo: str, settings: Any, process_gateway: Any
) -> None:
    """Declaring a megabyte and trickling holds what was sent: uploads that declared the whole
    budget leave room for the next request."""
    import requests

    budget = process_gateway.forward_budget
    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    settings.LLMGW_GATEWAY_FORWARD_MEMORY = 2 * 1024 * 1024
    held = [post_head(gateway_server.url, 1024 * 1024) for _ in range(3)]
    try:
        for sock in held:
            sock.sendall(b"a" * 1000)
        wait_for(lambda: budget.held == 3000, timeout=5, what="the 3,000 bytes sent held")
        response = requests.post(f"{gateway_server.url}/login/", data=b"x" * 100, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json()["body_bytes"] == 100
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: budget.held == 0, timeout=5, what="the uploads' bytes given back")
    assert budget.clients == {}


def test_big_bodies_leave_the_reserve_to_small_ones(
    gateway_server: Any, echo: str, settings: Any, process_gateway: Any
) -> None:
    """Past the budget less its reserve, a big body is refused 503 with Retry-After, and a
    small one (a login) still goes through."""
    import requests

    budget = process_gateway.forward_budget
    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    settings.LLMGW_GATEWAY_FORWARD_MEMORY = 2 * 1024 * 1024  # its reserve: at most half
    settings.LLMGW_GATEWAY_FORWARD_RESERVE = 1024 * 1024
    big = post_head(gateway_server.url, 1024 * 1024)
    try:
        big.sendall(b"a" * (1024 * 1024 - 1000))
        wait_for(lambda: budget.held == 1024 * 1024 - 1000, timeout=5, what="the big body held")
        with post_head(gateway_server.url, 100 * 1024) as another:
            another.sendall(b"b" * 2000)
            status, body = read_answer(another)
        assert status == 503
        refusal = json.loads(body)["error"]
        assert refusal["code"] == "gateway_busy"
        assert "try again in 1 seconds" in refusal["message"]
        response = requests.post(f"{gateway_server.url}/login/", data=b"x" * 100, timeout=10)
        assert response.status_code == 200, response.text
    finally:
        big.close()
    wait_for(lambda: budget.held == 0, timeout=5, what="the big body's bytes given back")
    assert refused(process_gateway, "budget") == 1


def test_one_address_holds_at_most_its_share(
    gateway_server: Any, echo: str, settings: Any, process_gateway: Any
) -> None:
    import requests

    budget = process_gateway.forward_budget
    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    settings.LLMGW_GATEWAY_FORWARD_PER_CLIENT = 64 * 1024
    held = post_head(gateway_server.url, 1024 * 1024)
    try:
        held.sendall(b"a" * 60 * 1024)
        wait_for(lambda: budget.clients == {"127.0.0.1": 60 * 1024}, timeout=5, what="60 KiB")
        response = requests.post(f"{gateway_server.url}/login/", data=b"x" * 8192, timeout=10)
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        assert response.json()["error"]["code"] == "client_busy"
        assert "65,536 bytes" in response.json()["error"]["message"]
    finally:
        held.close()
    wait_for(lambda: budget.held == 0, timeout=5, what="the upload's bytes given back")
    response = requests.post(f"{gateway_server.url}/login/", data=b"x" * 8192, timeout=10)
    assert response.status_code == 200
    assert refused(process_gateway, "client_share") == 1


@pytest.mark.parametrize(
    ("settings_for", "said"),
    [
        pytest.param(
            {"LLMGW_GATEWAY_BODY_DEADLINE": 1, "LLMGW_GATEWAY_BODY_MIN_RATE": 0},
            "did not arrive whole within 1 seconds",
            id="deadline",
        ),
        pytest.param(
            {"LLMGW_GATEWAY_BODY_MIN_RATE": 100_000},
            "arrived at under 100,000 bytes a second",
            id="rate",
        ),
    ],
)
def test_a_body_that_keeps_coming_too_slowly_is_a_408(
    gateway_server: Any,
    echo: str,
    settings: Any,
    monkeypatch: Any,
    process_gateway: Any,
    settings_for: dict[str, float],
    said: str,
) -> None:
    """A body sent steadily but too slowly is cut off by its deadline or its minimum rate,
    not only one that stops (the pause limit)."""
    from gateway import http

    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    for name, value in settings_for.items():
        setattr(settings, name, value)
    settings.LLMGW_GATEWAY_BODY_TIMEOUT = 5  # the pause limit, which is not what cuts it off
    monkeypatch.setattr(http, "RATE_GRACE_SECONDS", 0.1, raising=False)
    with post_head(gateway_server.url, 1024 * 1024) as sock:
        sock.sendall(b"a" * 1000)
        status, headers, body = whole_answer(sock)
    assert status == 408
    assert headers["retry-after"] == "1"
    assert headers["connection"] == "close"
    assert said in json.loads(body)["error"]["message"]
    reason = "deadline" if "whole" in said else "rate"
    assert refused(process_gateway, reason) == 1
    assert process_gateway.forward_budget.held == 0


def whole_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, header fields and body of the one answer before the server closes."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), fields, body


def refused(gateway: Any, reason: str) -> float:
    """llmgw_gateway_forward_refused{reason} of the gateway under test."""
    return float(gateway.metrics.forward_refused.labels(reason)._value.get())


def test_without_a_web_process_only_the_gateway_answers(gateway_server: Any, settings: Any) -> None:
    import requests

    settings.LLMGW_GATEWAY_FORWARD_TO = None
    response = requests.get(f"{gateway_server.url}/console/", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"


def test_the_gateway_trusts_no_proxy_unless_told(monkeypatch: Any) -> None:
    from pathlib import Path

    from llmgw_site.management.commands.llmgw_run import gateway_command

    monkeypatch.delenv("LLMGW_TRUSTED_PROXIES", raising=False)
    argv = gateway_command(Path("/bin"), "127.0.0.1", 8000, workers=2)
    assert "--no-proxy-headers" in argv and "--forwarded-allow-ips" not in argv
    assert "--no-server-header" in argv
    monkeypatch.setenv("LLMGW_TRUSTED_PROXIES", "10.0.0.5, 10.0.1.0/24")
    argv = gateway_command(Path("/bin"), "127.0.0.1", 8000, workers=2)
    assert "--no-proxy-headers" not in argv
    assert argv[argv.index("--forwarded-allow-ips") + 1] == "10.0.0.5,10.0.1.0/24"


@pytest.mark.parametrize(
    ("trusted", "seen_as"),
    [
        pytest.param("10.9.9.9", "127.0.0.1", id="the client is no trusted proxy"),
        pytest.param("127.0.0.1", "203.0.113.7", id="a trusted proxy's word is taken"),
    ],
)
def test_only_a_trusted_proxy_names_the_client(
    echo: str, settings: Any, monkeypatch: Any, trusted: str, seen_as: str
) -> None:
    import requests

    from gateway.asgi import application
    from tests.gateway.conftest import GatewayServer

    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    # The connections to the web belong to one event loop: this server makes its own.
    assert application.gateway is not None
    monkeypatch.setattr(application.gateway.web, "_session", None)
    server = GatewayServer(proxy_headers=True, forwarded_allow_ips=trusted)
    try:
        response = requests.get(
            f"{server.url}/login/", headers={"X-Forwarded-For": "203.0.113.7"}, timeout=10
        )
    finally:
        server.stop()
    assert response.status_code == 200, (response.status_code, response.text)
    assert response.json()["headers"]["x-forwarded-for"] == seen_as


def test_a_trusted_proxys_word_that_names_no_address_is_ignored(
    echo: str, settings: Any, monkeypatch: Any, caplog: Any
) -> None:
    """`not-an-ip` or markup where the client's address should be is not taken as the client's
    address: the proxy's own is (logged once, counted)."""
    import logging

    import requests

    from gateway.asgi import application
    from tests.gateway.conftest import GatewayServer

    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    assert application.gateway is not None
    monkeypatch.setattr(application.gateway.web, "_session", None)
    caplog.set_level(logging.WARNING, logger="llmgw.gateway")
    sent_and_seen = [
        ("not-an-ip", "127.0.0.1"),
        ('<svg onload="alert(1)">', "127.0.0.1"),
        ("203.0.113.7, unknown", "127.0.0.1"),
        ("not-an-ip, 203.0.113.7", "203.0.113.7"),
        ("203.0.113.7:4711", "203.0.113.7"),
    ]
    # A list of trusted proxies no other test names: such a value is logged once a process
    # for each list.
    server = GatewayServer(proxy_headers=True, forwarded_allow_ips="127.0.0.1, 192.0.2.250")
    try:
        seen = [
            requests.get(
                f"{server.url}/login/", headers={"X-Forwarded-For": sent}, timeout=10
            ).json()["headers"]["x-forwarded-for"]
            for sent, _ in sent_and_seen
        ]
    finally:
        server.stop()
    assert seen == [expected for _, expected in sent_and_seen]
    warnings = [r.getMessage() for r in caplog.records if "X-Forwarded-For" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'not-an-ip'" in warnings[0]
    ignored = application.gateway.metrics.forwarded_for_ignored
    assert ignored._value.get() == 3
