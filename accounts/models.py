"""People's API tokens, kept only as a hash.

A token is 24 random bytes (llmgw.bearer), so one SHA-256 is enough to make a stolen database
useless for logging in (a slow password hash protects guessable secrets; nothing here is
guessable), and a lookup stays one indexed query per request.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class ApiToken(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(
        max_length=100, blank=True, help_text="what the token is for, say a script or a laptop"
    )
    prefix = models.CharField(
        max_length=16, help_text="the token's first characters, to tell tokens apart"
    )
    digest = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the token")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(
        null=True, blank=True, help_text="to within a minute; empty when never used"
    )
    expires_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="refused from this time on; empty for never (a `llmgw ctl login` token expires)",
    )

    class Meta:
        verbose_name = "API token"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"


class DeviceLogin(models.Model):
    """A `llmgw ctl login` under way: the provider's device authorization (RFC 8628), polled by
    the control plane on the command's behalf until the person signs in, refuses, or it expires.

    The command holds `handle` (only its hash is kept here) and polls with it; the provider's
    device code stays here, never sent to the command. A row lives until `expires_at` (the
    provider's expiry, at most LOGIN_MAX_SECONDS) and is deleted after; at most
    MAX_PENDING_LOGINS are under way at once (signin.device)."""

    PENDING, DONE, FAILED = "pending", "done", "failed"
    STATES = [(s, s) for s in (PENDING, DONE, FAILED)]

    handle_digest = models.CharField(max_length=64, unique=True)
    device_code = models.CharField(max_length=2000)
    user_code = models.CharField(max_length=100)
    interval = models.PositiveIntegerField(default=5)
    state = models.CharField(max_length=10, choices=STATES, default=PENDING)
    message = models.CharField(max_length=500, blank=True, default="")
    client_name = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    polled_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()

    class Meta:
        verbose_name = "command-line sign-in"

    def __str__(self) -> str:
        return f"ctl login {self.user_code} ({self.state})"
