"""llmgw's settings pointed at the real provider of the tests (tests/support/oidc_provider.py),
with a client of its own registered there."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from tests.support.oidc_provider import OidcProvider


def use_provider(
    oidc_provider: OidcProvider,
    settings: Any,
    folder: Path,
    *,
    redirect_uris: list[str],
    group_map: str = "ml=member:research",
    **client: Any,
) -> str:
    """Registers a new client at the provider, its secret in an owner-only file, and sets llmgw's
    settings to sign in through it; the client id. The caller calls signin.oidc.forget_providers()
    once done."""
    from signin.oidc import forget_providers

    client_id, secret = oidc_provider.add_client(
        client_id=f"llmgw-{uuid.uuid4().hex[:8]}", redirect_uris=redirect_uris, **client
    )
    secret_file = folder / "client-secret"
    descriptor = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secret)
    settings.LLMGW_OIDC_ISSUER = oidc_provider.issuer
    settings.LLMGW_OIDC_CLIENT_ID = client_id
    settings.LLMGW_OIDC_CLIENT_SECRET_FILE = str(secret_file)
    settings.LLMGW_OIDC_SCOPES = "openid email profile groups offline_access"
    settings.LLMGW_OIDC_GROUP_MAP = group_map
    forget_providers()
    return client_id
