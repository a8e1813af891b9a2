"""Console fixtures: browser-like clients logged in as the named users, and a small fleet."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from tests.fleet.conftest import Fleet


@pytest.fixture
def client_for(users: dict[str, Any]) -> Any:
    """client_for("alice") is a Django test client logged in as alice, with CSRF checks on."""

    def make(name: str) -> Client:
        client = Client(enforce_csrf_checks=False)
        client.force_login(users[name])
        return client

    return make


@pytest.fixture
def htmx_headers() -> dict[str, str]:
    return {"HX-Request": "true", "HX-Current-URL": "http://testserver/"}


@pytest.fixture
def fleet(users: dict[str, Any]) -> Fleet:
    return Fleet(users["staff"], users["alice"])


@pytest.fixture
def running(fleet: Fleet, users: dict[str, Any]) -> Fleet:
    """alice's tiny-chat with one ready replica on node-a, and bob's other-chat not running."""
    from catalog.definitions import clean_definition
    from catalog.services import Actor, model_add
    from fleet.reconciler import reconcile_pass
    from tests.factories import definition

    fleet.node("node-a")
    fleet.add(
        "tiny-chat",
        adapters=[{"name": "tiny-sql", "source": "http://127.0.0.1:8000/mirror/a/b/c/sql.gguf"}],
    )
    reconcile_pass()
    fleet.beat("node-a")
    model_add(
        actor=Actor.for_user(users["bob"], "api"),
        definition=clean_definition(definition("other-chat", min_replicas=0, max_replicas=0)),
        source_check=False,
    )
    return fleet
