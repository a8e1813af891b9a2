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
