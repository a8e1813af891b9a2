"""Shared fixtures: a few named users (owner, teammate, outsider, staff) and API clients for each,
and a redis-server of a test's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.redis_server import RedisServer


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
