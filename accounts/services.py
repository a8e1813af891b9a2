"""Issuing and checking people's API tokens (`llmgw ctl`, scripts, the REST API)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Any

from django.utils import timezone

from .models import ApiToken

TOKEN_PREFIX = "llmgw_"
PREFIX_SHOWN = 12
# last_used_at is written at most this often per token, so that requests do not each write.
USE_RECORDED_EVERY = timedelta(minutes=1)


def token_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def new_secret() -> str:
    return TOKEN_PREFIX + secrets.token_hex(24)


def token_create(*, user: Any, name: str = "") -> tuple[ApiToken, str]:
    """A new token for `user`; the secret is returned this once and never stored."""
    secret = new_secret()
    token = ApiToken.objects.create(
        user=user, name=name, prefix=secret[:PREFIX_SHOWN], digest=token_digest(secret)
    )
    return token, secret


def token_user(secret: str) -> Any | None:
    """The active user a token belongs to, its use recorded; None for anything else."""
    if not secret or len(secret) > 200:
        return None
    token = ApiToken.objects.select_related("user").filter(digest=token_digest(secret)).first()
    if token is None or not token.user.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > USE_RECORDED_EVERY:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user
