"""The web's door stays open: while hundreds of anonymous clients hold uploads open, each
declaring a large body and trickling it, people log in, scripts write through the API and nodes
report, each answered within a second, through real gateway processes (as the run command starts
them) with the web process behind them."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import requests

from tests.support.system import System, wait_for

SLOW_UPLOADS = 200
DECLARED = 1024 * 1024  # the web's limit (LLMGW_MAX_BODY_BYTES), as a client may declare
FIRST_PIECE = 16


@pytest.fixture
def system(tmp_path: Path) -> Iterator[System]:
    running = System(tmp_path / "system")
    # The slow uploads are kept by their pause limit and deadline alone, so that none is cut off
    # for its rate while the checks run (the rate's own test is tests/gateway/test_forwarded.py).
    running.env["LLMGW_GATEWAY_BODY_MIN_RATE"] = "0"
    try:
        running.start(worker=False)
        yield running
    finally:
        running.close()


def held_bytes(url: str) -> float:
    """llmgw_gateway_forward_body_bytes, every gateway process together."""
    text = requests.get(f"{url}/metrics", timeout=5).text
    found = re.findall(r"^llmgw_gateway_forward_body_bytes(?:\{[^}]*\})? (\S+)$", text, re.M)
    return sum(float(value) for value in found)


def open_slow_uploads(url: str, count: int) -> list[socket.socket]:
    """`count` anonymous connections, each POSTing to /login/ a body it declares to be DECLARED
    bytes long, of which it sends FIRST_PIECE."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /login/ HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {DECLARED}\r\n\r\n"
    ).encode()
    uploads = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=10)
        uploads.append(sock)
        sock.sendall(head + b"a" * FIRST_PIECE)
    return uploads


def trickle(uploads: list[socket.socket]) -> None:
    """One more byte of each body."""
    for sock in uploads:
        sock.sendall(b"a")


def unanswered(sock: socket.socket) -> bool:
    """Whether the gateway has neither answered nor closed `sock`."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)
    return False


def timed(call: Callable[..., requests.Response], *args: Any, **kwargs: Any) -> Answered:
    started = time.monotonic()
    response = call(*args, **kwargs)
    return Answered(response, time.monotonic() - started)


class Answered(NamedTuple):
    response: requests.Response
    seconds: float


class Door:
    """A login, an API write and a node's report, each through the gateway."""

    def __init__(self, system: System, node_token: str) -> None:
        self.system = system
        self.node_token = node_token
        self.writes = 0

    def log_in(self) -> Answered:
        people = requests.Session()
        page = people.get(f"{self.system.url}/login/", timeout=10).text
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert csrf, page
        form = {
            "username": "admin",
            "password": self.system.admin_password,
            "csrfmiddlewaretoken": csrf[1],
        }
        return timed(
            people.post, f"{self.system.url}/login/", data=form, allow_redirects=False, timeout=10
        )

    def write(self) -> Answered:
        self.writes += 1
        return timed(
            requests.post,
            f"{self.system.url}/api/v1/nodes",
            json={"name": f"node-b{self.writes}"},
            headers=self.system.headers,
            timeout=10,
        )

    def report(self) -> Answered:
        return timed(
            requests.post,
            f"{self.system.url}/api/v1/node/heartbeat",
            json={"capacity": {"memory_gb": 4, "cores": 4}},
            headers={"Authorization": f"Bearer {self.node_token}"},
            timeout=10,
        )


def test_logins_api_writes_and_node_reports_pass_while_slow_uploads_hold_the_door(
    system: System,
) -> None:
    door = Door(system, system.add_node("node-a", memory_gb=4, cores=4, start=False))
    # What each takes with no slow uploads: the web's own work (a password's hash takes a few
    # hundred milliseconds, more on a busy machine) is not the gateway's to bound; under the
    # slow uploads each must take at most a second more.
    alone = {"login": door.log_in().seconds, "write": door.write().seconds}
    alone["report"] = door.report().seconds
    uploads = open_slow_uploads(system.url, SLOW_UPLOADS)
    try:
        wait_for(
            lambda: held_bytes(system.url) >= SLOW_UPLOADS * FIRST_PIECE,
            timeout=20,
            what=f"the gateway reading the {SLOW_UPLOADS} slow uploads",
        )
        for _ in range(3):
            trickle(uploads)
            login = door.log_in()
            assert login.response.status_code == 302, login.response.text
            assert login.response.headers["Location"] == "/", login.response.headers
            assert login.seconds < alone["login"] + 1, (login.seconds, alone)

            written = door.write()
            assert written.response.status_code == 201, written.response.text
            assert written.seconds < alone["write"] + 1, (written.seconds, alone)

            report = door.report()
            assert report.response.status_code == 200, report.response.text
            assert report.seconds < alone["report"] + 1, (report.seconds, alone)

        # The slow uploads were held open all along: none was answered or closed.
        assert sum(unanswered(sock) for sock in uploads) == SLOW_UPLOADS
    finally:
        for sock in uploads:
            sock.close()
    wait_for(lambda: held_bytes(system.url) == 0, timeout=20, what="the uploads' bytes given back")
