"""Gateway API keys: what applications send to `/v1/` instead of a user's API token."""

from __future__ import annotations

import hashlib
from datetime import timedelta

from django.conf import settings
from django.db import models

# How stale last_used_at may get (see gateway.state.LAST_USED_SECONDS): a key used
# a thousand times a second must not cost a thousand writes a second.
LAST_USED_RESOLUTION = timedelta(seconds=60)


def hash_key(secret: str) -> str:
    """Keys are long random strings, so one round of sha256 is enough to keep them unreadable."""
    return hashlib.sha256(secret.encode()).hexdigest()


class GatewayKey(models.Model):
    """One application's key to the gateway.

    Only the hash and a short prefix are kept: the key itself is shown once,
    when it is created. A revoked key stays listed (who had it, when it was
    last used) but opens nothing.
    """

    name = models.CharField(max_length=100, help_text="what the key is for, in your words")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="gateway_keys"
    )
    prefix = models.CharField(
        max_length=20, help_text="the key's first characters, to tell keys apart"
    )
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    last_used_at = models.DateTimeField(
        null=True, blank=True, help_text=f"to within {LAST_USED_RESOLUTION.seconds}s"
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "gateway key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    def state(self) -> str:
        return "revoked" if self.revoked_at else "active"


class RoutingVersion(models.Model):
    """One row that the database itself bumps whenever something the gateway routes by changes.

    Triggers (see migration 0002) on models, replicas, nodes and gateway keys bump
    it on SQLite, and send a `llmgw_routing` notification on PostgreSQL (sent when
    the change commits, and without the row lock a shared counter would take). The
    gateway's processes keep what they route by in memory and read it again when
    this moves or the notification comes; no writer can forget to say so, because
    none has to.
    """

    version = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"routing version {self.version}"
