"""Gateway fixtures: keys for the named users, models in the catalog, replicas on fake engines,
and the gateway's ASGI application served by uvicorn on 127.0.0.1 in a thread of the test process.

The gateway reads nothing from the database while it answers; its in-memory state is read by
the test itself (in the test's transaction) before each request, and what a request leaves to
write (idle clocks, last use of keys) is written after it, as the refresher thread would.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from catalog.definitions import clean_definition
from catalog.services import model_add
from core.actor import Actor
from fleet.models import Node, Replica, hash_token
from gateway.limits import SharedCounters
from tests.factories import definition
from tests.gateway.fake_engine import FakeEngine, fake_engine
from tests.support.waiting import wait_for


def _refresher_reads_uncommitted(sender: Any, connection: Any, **kwargs: Any) -> None:
    """On SQLite's in-memory test database, the refresher thread's reads take no table locks.

    That database is one shared cache for every connection of the test process, where a table
    another connection is writing is "locked" at once (SQLITE_LOCKED: no busy timeout applies),
    and a table it is reading cannot be written. A lifespan server's refresher reads through a
    connection of its own, twenty times a second, while the test (and the live server, which
    shares the test's connection) writes users and keys: either side then failed now and then,
    the refresher waiting RETRY_SECONDS before its next look, longer than a request waits for
    one, so a key created a moment ago got 401. A database file, as in production, makes each
    side wait its timeout instead. Reading uncommitted rows is harmless here: the test commits
    what it writes at once.
    """
    from gateway.state import REFRESHER_THREAD

    if (
        connection.vendor == "sqlite"
        and connection.is_in_memory_db()
        and threading.current_thread().name == REFRESHER_THREAD
    ):
        connection.connection.execute("PRAGMA read_uncommitted = 1")


class _Pools:
    """The connection pools (to engines, to the web) of the test process's per-test gateways:
    made on the event loop of the session's server, which closes them when it stops. A server
    started with its lifespan makes a gateway, and pools, of its own."""

    upstream: Any = None
    web: Any = None

    @classmethod
    def give(cls, gateway: Any) -> None:
        from gateway import proxy
        from gateway.webforward import Web

        if cls.upstream is None:
            cls.upstream, cls.web = proxy.Upstream(), Web()
        gateway.upstream, gateway.web = cls.upstream, cls.web

    @classmethod
    async def close(cls) -> None:
        if cls.upstream is not None:
            await cls.upstream.close()
            await cls.web.close()


@pytest.fixture(autouse=True)
def _fresh_gateway_state(settings: Any, monkeypatch: Any) -> Iterator[None]:
    """Each test starts with a fresh gateway object for the application (a fresh balancer,
    queue and traffic book), no cached catalog, no remembered demand and fresh metrics; a
    refresher thread (a lifespan server's) reads without locks on SQLite and, should a look
    still fail (a write of its own meeting the test's), looks again at the next poll."""
    from django.db.backends.signals import connection_created

    from access import traffic
    from gateway import metrics
    from gateway import state as gateway_state
    from gateway.asgi import Gateway as ProcessGateway
    from gateway.asgi import application
    from gateway.state import GatewayState

    settings.LLMGW_GATEWAY_WAIT = 0
    settings.LLMGW_METRICS_DIR = None
    settings.LLMGW_METRICS_OPEN = True
    monkeypatch.setattr(gateway_state, "RETRY_SECONDS", gateway_state.POLL_SECONDS)
    metrics.reset_for_tests()
    fresh = ProcessGateway(state=GatewayState(traffic.TrafficBook("test")))
    _Pools.give(fresh)
    monkeypatch.setattr(application, "gateway", fresh)
    connection_created.connect(_refresher_reads_uncommitted, dispatch_uid="refresher-uncommitted")
    yield
    connection_created.disconnect(dispatch_uid="refresher-uncommitted")
    metrics.reset_for_tests()


@pytest.fixture
def limit_counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SharedCounters]:
    """Fresh limit counters for the gateway under test, in a folder of its own (as one gateway
    process has): the limits' tests take them with `pytest.mark.usefixtures`."""
    from tests.support.gateway_state import current_state

    mine = SharedCounters(tmp_path / "gateway-limits", writer="test")
    monkeypatch.setattr(
        current_state(), "counters", mine
    )  # the gateway's (gateway.app.Gateway.counters)
    yield mine
    mine.close()


@pytest.fixture
def process_gateway() -> Any:
    """The gateway object the application serves with now (gateway.process.Gateway): this test's,
    or the one a server started with its lifespan made."""
    from gateway.asgi import application

    return application.gateway


class GatewayServer:
    """The gateway's ASGI application under uvicorn in a thread. With `lifespan`, it starts as
    a worker process does: its state read, and refreshed by its own thread on notifications."""

    def __init__(self, *, lifespan: bool = False, **config: Any) -> None:
        import uvicorn

        from gateway.asgi import application

        settings = {
            "host": "127.0.0.1",
            "port": 0,
            "lifespan": "on" if lifespan else "off",
            "log_level": "warning",
            # As the run command starts it (llmgw_run.gateway_command): no proxy trusted.
            "proxy_headers": False,
            "http": "gateway.protocol:GatewayProtocol",
            "ws": "none",
            **config,
        }
        self.server = uvicorn.Server(uvicorn.Config(application, **settings))
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=10, what="uvicorn to start")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _serve(self) -> None:
        try:
            await self.server.serve()
        finally:
            await _Pools.close()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def gateway_server() -> Iterator[GatewayServer]:
    running = GatewayServer()
    yield running
    running.stop()


@pytest.fixture
def keys(users: dict[str, Any]) -> dict[str, str]:
    """A gateway key for each named user: keys["alice"] is alice's."""
    from access.services import key_create

    return {
        name: key_create(actor=Actor.for_user(user, "api"), name=f"{name}'s app")[1]
        for name, user in users.items()
    }


class Gateway:
    """Requests to the running gateway; the state is read before each and written after."""

    def __init__(self, url: str, key: str | None) -> None:
        self.url = url
        self.key = key

    def request(
        self, method: str, path: str, *, key: str | None = None, stream: bool = False, **kwargs: Any
    ) -> requests.Response:
        from tests.support.gateway_state import current_state

        state = current_state()
        state.reload()
        headers = kwargs.pop("headers", {})
        if (key or self.key) and "Authorization" not in headers:
            headers["Authorization"] = f"Bearer {key or self.key}"
        response = requests.request(
            method, self.url + path, headers=headers, timeout=30, stream=stream, **kwargs
        )
        if not stream:
            state.flush()
        return response

    def post(self, path: str, body: Any, key: str | None = None, stream: bool = False) -> Any:
        if isinstance(body, str | bytes):
            return self.request("POST", path, key=key, data=body, stream=stream)
        return self.request("POST", path, key=key, json=body, stream=stream)

    def get(self, path: str, key: str | None = None) -> Any:
        return self.request("GET", path, key=key)


@pytest.fixture
def gw(gateway_server: GatewayServer, keys: dict[str, str]) -> Gateway:
    """gw.post("/v1/completions", {...}) and gw.get(...) with alice's gateway key."""
    return Gateway(gateway_server.url, keys["alice"])


class Catalog:
    """Models added through the catalog's service, and replicas placed by hand on fake engines."""

    def __init__(self, owner: Any) -> None:
        self.owner = Actor.for_user(owner, "api")
        from django.utils import timezone

        self.node = Node.objects.create(
            name="node-a",
            token_hash=hash_token("node-a"),
            address="127.0.0.1",
            memory_gb=16,
            cores=8,
            last_heartbeat=timezone.now(),
        )

    def add(self, name: str, **overrides: Any) -> Any:
        return model_add(
            actor=self.owner,
            definition=clean_definition(definition(name, **overrides)),
            source_check=False,
        )

    def replica(
        self,
        model: str,
        engine: FakeEngine | int,
        *,
        state: str = Replica.READY,
        adapters: tuple[str, ...] = (),
        scales: tuple[float, ...] = (),
    ) -> Replica:
        from catalog.models import Model

        port = engine if isinstance(engine, int) else engine.port
        return Replica.objects.create(
            model=Model.objects.get(name=model),
            model_name=model,
            node=self.node,
            profile="cpu",
            spec={
                "adapters": [
                    {"name": a, "source": "x", **({"scale": s} if s is not None else {})}
                    for a, s in zip(adapters, scales or [None] * len(adapters), strict=True)
                ]
            },
            spec_key="k",
            state=state,
            port=port,
        )


@pytest.fixture
def catalog(users: dict[str, Any]) -> Catalog:
    return Catalog(users["alice"])


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    with fake_engine() as running:
        yield running


@pytest.fixture
def other_engine() -> Iterator[FakeEngine]:
    with fake_engine() as running:
        yield running


@pytest.fixture
def echo() -> Iterator[str]:
    """A web process stand-in that answers with the request line and headers it got."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            headers = {k.lower(): v for k, v in self.headers.items()}
            length = int(self.headers.get("content-length") or 0)
            received = self.rfile.read(length) if length else b""
            body = json.dumps(
                {"path": self.path, "headers": headers, "body_bytes": len(received)}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Set-Cookie", "a=1")
            self.send_header("Set-Cookie", "b=2")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def __getattr__(self, name: str) -> Any:
            # Any method: do_POST, do_OPTIONS, do_PROPFIND…
            if name.startswith("do_"):
                return self.do_GET
            raise AttributeError(name)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)
