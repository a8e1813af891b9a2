"""Reads of gateway keys, shaped for the API and the CLI."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from catalog.services import Actor

from .models import GatewayKey


def keys_visible_to(actor: Actor) -> QuerySet[GatewayKey]:
    """A user sees their own keys; staff see everyone's."""
    keys = GatewayKey.objects.select_related("owner", "revoked_by").order_by("-created_at", "-id")
    if actor.is_staff:
        return keys
    return keys.filter(owner=actor.user)


def key_view(key: GatewayKey) -> dict[str, Any]:
    return {
        "id": key.pk,
        "name": key.name,
        "prefix": key.prefix,
        "owner": key.owner.get_username(),
        "state": key.state(),
        "created_at": key.created_at.isoformat(),
        "last_used_at": key.last_used_at.isoformat() if key.last_used_at else None,
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
        "revoked_by": key.revoked_by.get_username() if key.revoked_by else None,
    }
