"""Gateway API keys: what applications send to `/v1/` instead of a user's API token."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models

# How stale last_used_at may get before a request writes it again: a key used
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

    def record_use(self, now: datetime) -> bool:
        """Record a use; True when that needed a write (the last one is older than the resolution)."""
        if self.last_used_at is not None and now - self.last_used_at < LAST_USED_RESOLUTION:
            return False
        GatewayKey.objects.filter(pk=self.pk).update(last_used_at=now)
        self.last_used_at = now
        return True

    def state(self) -> str:
        return "revoked" if self.revoked_at else "active"
