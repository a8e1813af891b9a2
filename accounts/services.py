"""Issuing and checking people's API tokens (`llmgw ctl`, scripts, the REST API)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from llmgw.bearer import API_TOKEN, digest

from .models import ApiToken

# last_used_at is written at most this often per token, so that requests do not each write.
USE_RECORDED_EVERY = timedelta(minutes=1)


def token_create(*, user: Any, name: str = "") -> tuple[ApiToken, str]:
    """A new token for `user`; the secret is returned this once and never stored."""
    secret = API_TOKEN.new()
    token = ApiToken.objects.create(
        user=user, name=name, prefix=API_TOKEN.shown_part(secret), digest=digest(secret)
    )
    return token, secret


def token_user(secret: str) -> Any | None:
    """The active user a token belongs to, its use recorded; None for anything else."""
    if not secret or len(secret) > 200:
        return None
    token = ApiToken.objects.select_related("user").filter(digest=digest(secret)).first()
    if token is None or not token.user.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > USE_RECORDED_EVERY:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user
