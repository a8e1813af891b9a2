"""Console fixtures: browser-like clients logged in as the named users, and a small fleet."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from tests.fleet.conftest import Fleet

# Debian's Chromium (no browser download); the browser tests skip when it is missing.
CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"

# The marks of a browser test: Chromium and Playwright, each skipping the test with how to get it.
IN_A_BROWSER = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason=f"{CHROMIUM} is missing: `apt-get install -y chromium` (Debian's package)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="the playwright package is missing: `pip install playwright` (no `playwright install`)",
    ),
]


def whole_product_in_a_browser() -> list[pytest.MarkDecorator]:
    """The marks of a browser test against the whole product: those of IN_A_BROWSER, a built
    llama-server and the local registry, each skipping the test with how to get it."""
    from llmgw.engine import find_engine
    from tests.support.registry import available

    return [
        *IN_A_BROWSER,
        pytest.mark.engine,
        pytest.mark.skipif(
            find_engine() is None, reason="llama-server is not built (make setup builds it)"
        ),
        pytest.mark.skipif(available() is not None, reason=str(available())),
    ]


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
    from catalog.services import model_add
    from core.actor import Actor
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


@pytest.fixture
def chromium(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    # Playwright's sync API runs an event loop in this thread; the ORM calls the
    # test makes between browser steps are still plain synchronous calls.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield browser
        finally:
            browser.close()
            # Database connections opened while Playwright ran belong to its context
            # (Django keeps them per context); PostgreSQL would otherwise refuse to
            # drop the test database at the end while one of them is still open.
            from django.db import connections

            connections.close_all()
