"""The web process behind the gateway takes the client's address from X-Forwarded-For."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.forwarded import client_address_from_gateway

pytestmark = pytest.mark.smoke


def seen(environ: dict[str, Any]) -> str:
    addresses: list[str] = []

    def app(env: dict[str, Any], start_response: Any) -> list[bytes]:
        addresses.append(env["REMOTE_ADDR"])
        return []

    client_address_from_gateway(app)(environ, None)
    return addresses[0]


def test_it_takes_the_address_the_gateway_set() -> None:
    assert (
        seen({"REMOTE_ADDR": "127.0.0.1", "HTTP_X_FORWARDED_FOR": "203.0.113.7"}) == "203.0.113.7"
    )


def test_it_takes_the_last_address_when_there_are_several() -> None:
    environ = {"REMOTE_ADDR": "127.0.0.1", "HTTP_X_FORWARDED_FOR": "10.0.0.1, 203.0.113.7"}
    assert seen(environ) == "203.0.113.7"


def test_it_trusts_the_header_only_from_this_machine() -> None:
    environ = {"REMOTE_ADDR": "198.51.100.2", "HTTP_X_FORWARDED_FOR": "203.0.113.7"}
    assert seen(environ) == "198.51.100.2"


@pytest.fixture
def echo() -> Any:
    """A web process stand-in that answers with the request line and headers it got."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            headers = {k.lower(): v for k, v in self.headers.items()}
            body = json.dumps({"path": self.path, "headers": headers}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Set-Cookie", "a=1")
            self.send_header("Set-Cookie", "b=2")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


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


def test_without_a_web_process_only_the_gateway_answers(gateway_server: Any, settings: Any) -> None:
    import requests

    settings.LLMGW_GATEWAY_FORWARD_TO = None
    response = requests.get(f"{gateway_server.url}/console/", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"
