"""A request held in the running gateway's fair queue lands in the traffic figures and on the
model's page: waiting while it waits, and its wait once it was served (end to end, through a
gateway process started as a worker starts, with its queue file under var/gateway-queue)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from access import live
from access.models import TrafficMinute
from gateway.asgi import application
from tests.console.pages import text_of
from tests.gateway.conftest import Gateway, GatewayServer
from tests.gateway.fake_engine import FakeEngine
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def worker(settings: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A gateway started with its lifespan (Gateway.started: the fair queue on its own file, its
    waits reported to the traffic book), its shared files in a var folder of the test's own,
    which the console reads too."""
    settings.VAR_DIR = tmp_path / "var"
    settings.VAR_DIR.mkdir()
    # Its own gateway object (fair queue, connections to the engines, traffic book), which
    # the conftest's fixture puts back afterwards.
    running = GatewayServer(lifespan=True)
    yield running
    running.stop()


def test_a_request_that_waited_for_a_busy_slot_is_counted_and_shown(
    worker: GatewayServer,
    catalog: Any,
    engine: FakeEngine,
    keys: dict[str, str],
    users: dict[str, Any],
    api: Any,
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)  # one slot
    gw = Gateway(worker.url, keys["alice"])
    engine.events, engine.delay = 4, 0.4  # a stream holds the slot for about 1.6 s
    answers: dict[str, Any] = {}

    def send(name: str, **body: Any) -> None:
        try:
            response = gw.post("/v1/completions", {"model": "chat", "prompt": "a", **body})
            answers[name] = (response.status_code, response.content)
        finally:
            connection.close()  # this thread's (gw reads the state before, writes it after)

    holder = threading.Thread(target=send, args=("holder",), kwargs={"stream": True})
    holder.start()
    assert engine.stream_started.wait(10)
    waiter = threading.Thread(target=send, args=("waiter",))
    waiter.start()
    wait_for(
        lambda: live.waiting_now(["chat"])["chat"] == 1,
        timeout=10,
        what="the second request waiting for chat's busy slot",
    )

    page = Client()
    page.force_login(users["alice"])
    html = page.get("/models/chat/").content.decode()
    assert 'data-waiting="1"' in html
    assert "Waiting for a free slot now: 1" in text_of(page.get("/models/chat/"))

    holder.join(15)
    waiter.join(15)
    assert answers["holder"][0] == 200 and b"[DONE]" in answers["holder"][1]
    assert answers["waiter"][0] == 200
    assert live.waiting_now(["chat"]) == {"chat": 0}
    assert application.gateway is not None
    application.gateway.book.flush()  # as the worker's state thread does every few seconds

    waited = TrafficMinute.objects.get(model="chat", queued__gt=0)
    assert (waited.queued, waited.queue_timeouts, waited.queue_full) == (1, 0, 0)
    # It waited for most of the holder's stream.
    assert 0.5 < waited.queue_seconds == waited.queue_seconds_max < 10
    text = text_of(page.get("/models/chat/"))
    assert "Waiting for a free slot now: 0" in text
    assert (
        f"Fair queue in the last hour: 1 request waited for a free slot, mean "
        f"{waited.queue_seconds:.2f} s, longest {waited.queue_seconds:.2f} s; 0 timed out (503), "
        "0 refused as the queue was full (429)."
    ) in text
    total = api("bob").get("/api/v1/models/chat/traffic").json()["total"]
    assert (total["requests"], total["queued"]) == (2, 1)
    assert total["queue_seconds_max"] == pytest.approx(waited.queue_seconds)
