"""Sign-in fixtures: a stub provider on 127.0.0.1 and llmgw configured to use it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.signin.stub_provider import CLIENT_ID, CLIENT_SECRET, StubProvider


@pytest.fixture(scope="session")
def stub_provider_server() -> Iterator[StubProvider]:
    provider = StubProvider().start()
    yield provider
    provider.stop()


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "client-secret"
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(handle, "w") as out:
        out.write(CLIENT_SECRET + "\n")
    return path


@pytest.fixture
def provider(
    stub_provider_server: StubProvider, settings: Any, secret_file: Path
) -> Iterator[StubProvider]:
    """The stub provider, reset, and llmgw's settings pointing at it (groups: llm-users makes a
    member of the team research, llm-admins an admin)."""
    from signin.oidc import forget_providers

    stub_provider_server.reset()
    settings.LLMGW_OIDC_ISSUER = stub_provider_server.issuer
    settings.LLMGW_OIDC_CLIENT_ID = CLIENT_ID
    settings.LLMGW_OIDC_CLIENT_SECRET_FILE = str(secret_file)
    settings.LLMGW_OIDC_SCOPES = "openid email profile groups offline_access"
    settings.LLMGW_OIDC_GROUPS_CLAIM = "groups"
    settings.LLMGW_OIDC_ALLOWED_HOSTS = []
    settings.LLMGW_OIDC_GROUP_MAP = "llm-users=member:research, llm-admins=admin"
    settings.LLMGW_PUBLIC_URL = "http://testserver"
    forget_providers()
    yield stub_provider_server
    forget_providers()
