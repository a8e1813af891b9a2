"""Who signed in through the provider: an identity per (issuer, subject), linked to one user."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Identity(models.Model):
    """A person at the provider, known by the issuer and the subject it gives them.

    A user is found by these two alone, never by e-mail: an address can be given to someone
    else, or set by the person themselves at some providers, and matching on it would hand
    them the account of whoever had it before.
    """

    issuer = models.CharField(max_length=255)
    subject = models.CharField(max_length=255)
    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="signin_identity"
    )
    groups = models.JSONField(
        default=list, blank=True, help_text="the groups the provider gave at the last sign-in"
    )
    signed_in_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Encrypted with a key derived from LLMGW_SECRET_KEY (signin.people.refresh_token_of reads
    # it); never shown. Empty when the provider gave none. A new secret key makes it unreadable,
    # which counts as none.
    refresh_token = models.TextField(blank=True, default="", editable=False)
    # When the provider was last asked about the person between sign-ins (signin.leavers).
    checked_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        verbose_name_plural = "identities"
        constraints = [
            models.UniqueConstraint(fields=["issuer", "subject"], name="signin_identity_once"),
        ]

    def __str__(self) -> str:
        return f"{self.user} ({self.subject} at {self.issuer})"


class SpentNonce(models.Model):
    """A nonce whose ID token was taken: the same token is never taken twice."""

    digest = models.CharField(max_length=64, unique=True)  # sha256 of the nonce
    until = models.DateTimeField(db_index=True)

    def __str__(self) -> str:
        return self.digest
