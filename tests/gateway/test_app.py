"""The gateway as an object (gateway.process.Gateway): each application has its own state, pools
and figures, and a test can make one that shares nothing with the process's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.app import Application
from gateway.process import Gateway
from gateway.state import GatewayState

pytestmark = pytest.mark.django_db


def test_it_makes_a_gateway_that_shares_nothing_with_another() -> None:
    mine, other = Gateway(), Gateway()
    assert mine.state is not other.state
    assert mine.book is not other.book
    assert mine.balancer is not other.balancer
    assert mine.queue is not other.queue
    assert mine.upstream is not other.upstream and mine.web is not other.web
    assert mine.counters is not other.counters
    assert mine.state.counters is mine.counters  # the budgets' reads see them


def test_its_queue_reports_to_it() -> None:
    mine = Gateway()
    # Depths into its metrics, waits into its metrics and its traffic book.
    assert mine.queue.on_depth == mine._queue_depth
    assert mine.queue.on_wait == mine._queue_wait


def call(application: Application, path: str, method: str = "GET") -> tuple[int, bytes]:
    """One request to the application, straight through ASGI."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    asyncio.run(application(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_an_application_answers_with_the_gateway_it_was_given() -> None:
    application = Application()
    own = Gateway(state=GatewayState())
    application.gateway = own
    status, body = call(application, "/v1/nope")
    assert status == 404 and b"There is no endpoint /v1/nope." in body
    status, _ = call(application, "/v1/models")
    assert status == 401  # no key: refused before any state is read
    assert application.gateway is own


def test_each_gateway_throttles_its_own_idle_clock_writes(db: Any) -> None:
    """An on-demand model's idle clock is written at most every few seconds per gateway: the
    throttle is the gateway's state's, so another gateway (a test's, a second app) writes its own."""
    from catalog.models import Model

    entry = _sleepy()
    mine, other = Gateway(), Gateway()

    def asked(gateway: Gateway) -> Any:
        Model.objects.filter(name="sleepy").update(demand_at=None)
        gateway.state.asked_for(entry, nothing_ready=False)
        gateway.state.flush()
        return Model.objects.get(name="sleepy").demand_at

    assert asked(mine) is not None  # the first ask is written
    assert asked(mine) is None  # the next, within the refresh interval, is not
    assert asked(other) is not None  # another gateway keeps its own clock


def test_what_requests_leave_to_write_waits_for_the_database(
    db: Any, monkeypatch: pytest.MonkeyPatch, django_user_model: Any
) -> None:
    """An idle clock and a key's last use that could not be written are kept, with what came
    since, and written once the database answers again."""
    from django.db import OperationalError

    from access import services
    from access.models import GatewayKey
    from catalog.models import Model

    owner = django_user_model.objects.create_user("alice", password="alice-password-1")
    key = GatewayKey.objects.create(owner=owner, name="app", key_hash="h" * 64, prefix="llmgw-x")
    entry = _sleepy()
    state = Gateway().state
    state.asked_for(entry, nothing_ready=False)
    state.key_used(key.pk)
    writes = {"model_asked_for": services.model_asked_for, "keys_used": services.keys_used}

    def away(*_: Any, **__: Any) -> None:
        raise OperationalError("the database is away")

    for name in writes:
        monkeypatch.setattr(services, name, away)
    with pytest.raises(OperationalError):
        state.flush()
    monkeypatch.setattr(services, "model_asked_for", writes["model_asked_for"])
    with pytest.raises(OperationalError):
        state.flush()  # the idle clock is written now; the last use still waits
    assert Model.objects.get(name="sleepy").demand_at is not None
    monkeypatch.setattr(services, "keys_used", writes["keys_used"])
    state.flush()
    key.refresh_from_db()
    assert key.last_used_at is not None


def _sleepy() -> Any:
    """An on-demand model in the catalog (it has an idle clock), and its routing entry."""
    from catalog.models import Model
    from gateway.routing import Entry

    Model.objects.create(
        name="sleepy", source="file:///models/sleepy.gguf", min_replicas=0, max_replicas=1
    )
    return Entry(
        name="sleepy",
        model="sleepy",
        adapter=False,
        on_demand=True,
        parked=False,
        fallbacks=(),
        idle_timeout=600,
        owner=None,
        created=0,
    )
