"""Gateway fixtures: keys for the named users, models in the catalog, replicas on fake engines."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from catalog.definitions import clean_definition
from catalog.services import Actor, model_add
from fleet.models import Node, Replica, hash_token
from tests.factories import definition
from tests.gateway.fake_engine import FakeEngine, fake_engine


@pytest.fixture(autouse=True)
def _fresh_gateway_state(settings: Any, monkeypatch: Any) -> Iterator[None]:
    """Each test starts with no cached catalog, no remembered demand and fresh metrics."""
    from gateway import metrics, routing, services

    settings.LLMGW_GATEWAY_WAIT = 0
    settings.LLMGW_METRICS_DIR = None
    routing.catalog_cache.clear()
    monkeypatch.setattr(routing, "balancer", routing.Balancer())
    services.forget_demand()
    metrics.reset_for_tests()
    yield
    routing.catalog_cache.clear()
    metrics.reset_for_tests()


@pytest.fixture
def keys(users: dict[str, Any]) -> dict[str, str]:
    """A gateway key for each named user: keys["alice"] is alice's."""
    from gateway.services import key_create

    return {
        name: key_create(actor=Actor.for_user(user, "api"), name=f"{name}'s app")[1]
        for name, user in users.items()
    }


@pytest.fixture
def gw(client: Any, keys: dict[str, str]) -> Any:
    """gw.post("/v1/completions", {...}) and gw.get(...) with alice's gateway key."""

    class Gateway:
        key = keys["alice"]

        def post(self, path: str, body: Any, key: str | None = None) -> Any:
            return client.post(
                path,
                body,
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Bearer {key or self.key}",
            )

        def get(self, path: str, key: str | None = None) -> Any:
            return client.get(path, HTTP_AUTHORIZATION=f"Bearer {key or self.key}")

    return Gateway()


class Catalog:
    """Models added through the catalog's service, and replicas placed by hand on fake engines."""

    def __init__(self, owner: Any) -> None:
        self.owner = Actor.for_user(owner, "api")
        self.node = Node.objects.create(
            name="node-a", token_hash=hash_token("node-a"), address="127.0.0.1"
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
    ) -> Replica:
        from catalog.models import Model

        port = engine if isinstance(engine, int) else engine.port
        return Replica.objects.create(
            model=Model.objects.get(name=model),
            model_name=model,
            node=self.node,
            profile="cpu",
            spec={"adapters": [{"name": a, "source": "x"} for a in adapters]},
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
