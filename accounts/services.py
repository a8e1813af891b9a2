"""Issuing and checking people's API tokens (`llmgw ctl`, scripts, the REST API)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from llmgw.bearer import API_TOKEN, digest

from .models import ApiToken

# last_used_at is written at most this often per token, so that requests do not each write.
USE_RECORDED_EVERY = timedelta(minutes=1)


def token_create(
    *, user: Any, name: str = "", expires_at: datetime | None = None
) -> tuple[ApiToken, str]:
    """A new token for `user`, refused from `expires_at` on (None: never); the secret is
    returned this once and never stored."""
    secret = API_TOKEN.new()
    token = ApiToken.objects.create(
        user=user,
        name=name,
        prefix=API_TOKEN.shown_part(secret),
        digest=digest(secret),
        expires_at=expires_at,
    )
    return token, secret


def tokens_of(user: Any) -> list[ApiToken]:
    """`user`'s tokens, the newest first, expired ones included (they show as expired)."""
    return list(ApiToken.objects.filter(user=user))


def token_revoke(*, user: Any, token_id: int) -> ApiToken | None:
    """Delete one of `user`'s tokens: refused from the next request on. None when `user` has
    no such token (another's token is no different from none)."""
    token = ApiToken.objects.filter(user=user, pk=token_id).first()
    if token is not None:
        token.delete()
    return token


def revoke_all(user: Any) -> int:
    """Every token of `user` deleted (a leaver's); how many there were."""
    deleted, _ = ApiToken.objects.filter(user=user).delete()
    return deleted


def token_user(secret: str) -> Any | None:
    """The active user a token belongs to, its use recorded; None for anything else."""
    if not secret or len(secret) > 200:
        return None
    token = ApiToken.objects.select_related("user").filter(digest=digest(secret)).first()
    if token is None or not token.user.is_active:
        return None
    now = timezone.now()
    if token.expires_at is not None and token.expires_at <= now:
        return None
    if token.last_used_at is None or now - token.last_used_at > USE_RECORDED_EVERY:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user
