"""The web process behind the gateway takes the client's address from the gateway alone, and the
gateway passes on no client's word on who it is."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.forwarded import client_address_from_gateway
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


def test_bodies_held_for_the_web_have_a_budget(
    gateway_server: Any, echo: str, settings: Any
) -> None:
    """Unfinished uploads pin no more than LLMGW_GATEWAY_FORWARD_MEMORY: past it, a 503."""
    import socket

    import requests

    from gateway.asgi import application

    assert application.gateway is not None
    budget = application.gateway.forward_budget
    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024
    settings.LLMGW_GATEWAY_FORWARD_MEMORY = 2 * 1024 * 1024
    host, port = gateway_server.url.removeprefix("http://").split(":")
    held = []
    try:
        for _ in range(2):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"POST /login/ HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\nab")
            held.append(sock)
        wait_for(
            lambda: budget.held >= 2 * 1024 * 1024,
            timeout=5,
            what="the two unfinished uploads' 2 MiB held",
        )
        assert budget.held == 2 * 1024 * 1024
        response = requests.post(f"{gateway_server.url}/login/", data=b"x" * 100, timeout=10)
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        assert response.json()["error"]["code"] == "gateway_busy"
    finally:
        for sock in held:
            sock.close()
    wait_for(
        lambda: budget.held == 0, timeout=5, what="the uploads' memory given back once they closed"
    )
    response = requests.post(f"{gateway_server.url}/login/", data=b"x" * 100, timeout=10)
    assert response.status_code == 200


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
