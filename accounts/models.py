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

    class Meta:
        verbose_name = "API token"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"
