"""Shared fixtures: a few named users (owner, teammate, outsider, staff) and API clients for each,
and a redis-server of a test's own; and the places each test process keeps to itself.

The suite runs on several processes at once (pytest-xdist: `make test`). Each has a test database
of its own (pytest-django names it after the worker), and, set here before any test runs:
- a var folder of its own (LLMGW_VAR_DIR: the gateway's counters and queue files, the broker's
  folders), in a temporary folder removed when the process ends, never the checkout's var/;
- a Redis database of its own where REDIS_URL is set (its number plus the worker's, modulo 16):
  the gateway's limit counters there are named after keys' ids, which every worker's database
  numbers from 1.
What a test starts (tests.support.system) inherits both through the environment.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import yaml

from tests.support.ports import worker_number
from tests.support.redis_server import RedisServer

REDIS_DATABASES = 16  # redis-server's default number of databases


def _redis_url_of_worker(url: str, number: int) -> str:
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(base + 1 + number) % REDIS_DATABASES}"))


def _give_this_process_its_own_places() -> Path:
    from django.conf import settings

    var = Path(tempfile.mkdtemp(prefix="llmgw-test-var-"))
    os.environ["LLMGW_VAR_DIR"] = str(var)
    settings.VAR_DIR = var
    # A gateway served inside this process leaves its collector as it is (the gateway's own
    # processes, which the tests start, tune theirs: gateway.process.tune_collector).
    settings.LLMGW_GATEWAY_GC_FREEZE = False
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {})
    if "data_folder_in" in options:  # the broker kept in files (no REDIS_URL)
        broker = var / "broker"
        for sub in ("queue", "processed", "control"):
            (broker / sub).mkdir(parents=True)
        options.update(
            data_folder_in=str(broker / "queue"),
            data_folder_out=str(broker / "queue"),
            processed_folder=str(broker / "processed"),
            control_folder=str(broker / "control"),
        )
    number = worker_number()
    if number is not None and os.environ.get("REDIS_URL"):
        url = _redis_url_of_worker(os.environ["REDIS_URL"], number)
        os.environ["REDIS_URL"] = url
        settings.REDIS_URL = settings.CELERY_BROKER_URL = url
    return var


_VAR = _give_this_process_its_own_places()

# The fault matrix's tests carry a seed drawn at collection in their ids, and may draw their
# cells from it (tests/test_fault_matrix.py); every worker must collect the same tests, so the
# seed is drawn once, here in the process that starts them (they inherit its environment), when
# LLMGW_FAULT_SEED does not give one.
if worker_number() is None and not os.environ.get("LLMGW_FAULT_SEED", "").strip():
    os.environ["LLMGW_FAULT_SEED"] = str(random.SystemRandom().randrange(1, 10**6))


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_VAR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fast_passwords(settings: Any) -> None:
    # The real hasher is slow on purpose; tests only need passwords to match.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    # Tests run reconcile passes themselves; no broker needed for a kick.
    settings.LLMGW_KICK_RECONCILE = False
    # A node's renewal is written in its request, not by a thread a second later (whose own
    # database connection would outlive the test); tests of fleet.liveness set it themselves.
    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 0


@pytest.fixture
def users(db: Any) -> dict[str, Any]:
    from django.contrib.auth import get_user_model

    User = get_user_model()
    return {
        "alice": User.objects.create_user("alice", password="alice-password-1"),
        "bob": User.objects.create_user("bob", password="bob-password-1"),
        "carol": User.objects.create_user("carol", password="carol-password-1"),
        "staff": User.objects.create_user("staff", password="staff-password-1", is_staff=True),
    }


@pytest.fixture
def tokens(users: dict[str, Any]) -> dict[str, str]:
    from accounts.services import token_create

    return {name: token_create(user=user)[1] for name, user in users.items()}


@pytest.fixture
def api(tokens: dict[str, str]) -> Any:
    """api("alice") is a DRF test client authenticated as alice."""
    from rest_framework.test import APIClient

    def client_for(name: str) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {tokens[name]}")
        return client

    return client_for


@pytest.fixture
def server_yaml(tmp_path: Path, settings: Any) -> Any:
    """write(dict_or_text) writes server.yaml in a temporary folder and makes it the one in force."""
    from catalog.config import current_config

    path = tmp_path / "server.yaml"
    settings.LLMGW_CONFIG = path

    def write(content: Any) -> Path:
        path.write_text(
            content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False)
        )
        current_config.cache_clear()
        return path

    current_config.cache_clear()
    yield write
    current_config.cache_clear()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own (tests.support.redis_server), stopped by its pid."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share a module-scoped fixture (a whole llmgw, an engine, a registry) are one
    group for pytest-xdist (`--dist loadgroup`): one worker runs them all and starts what they
    share once. (xdist hands out the groups before single tests, largest first.)"""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures is None or item.get_closest_marker("xdist_group"):
            continue
        scopes = {d.scope for defs in fixtures.name2fixturedefs.values() for d in defs}
        if "module" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))  # type: ignore[attr-defined]


def pytest_collection_finish(session: pytest.Session) -> None:
    """A worker whose groups did not take (pytest-xdist names a grouped test `ID@GROUP` for the
    scheduler) would spread a module's tests over workers, each starting what they share and
    the later ones finding it without what the earlier ones made: stop at once instead."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [
        item.nodeid
        for item in session.items
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
    ]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(lost)} tests (first: {lost[0]}): this pytest "
            f"({pytest.__version__}) and pytest-xdist do not work together; pyproject.toml "
            "pins the versions that do."
        )
