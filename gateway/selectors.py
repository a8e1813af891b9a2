"""Reads of gateway keys and their usage, shaped for the API, the console and the CLI."""

from __future__ import annotations

from datetime import date
from typing import Any

from django.db.models import QuerySet, Sum

from catalog.services import Actor

from .models import GatewayKey, KeyUsageDay


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


def key_usage(
    actor: Actor,
    *,
    key_id: int | None = None,
    model: str | None = None,
    since: date | None = None,
) -> list[dict[str, Any]]:
    """Requests and tokens per day, key and model, newest day first, of the keys `actor` sees."""
    rows = (
        KeyUsageDay.objects.filter(key__in=keys_visible_to(actor).order_by())
        .values("day", "key_id", "key__name", "key__prefix", "key__owner__username", "model")
        .annotate(
            requests_sum=Sum("requests"),
            prompt_sum=Sum("prompt_tokens"),
            completion_sum=Sum("completion_tokens"),
        )
        .order_by("-day", "key_id", "model")
    )
    if key_id is not None:
        rows = rows.filter(key_id=key_id)
    if model:
        rows = rows.filter(model=model)
    if since is not None:
        rows = rows.filter(day__gte=since)
    return [
        {
            "day": row["day"].isoformat(),
            "key": row["key_id"],
            "key_name": row["key__name"],
            "key_prefix": row["key__prefix"],
            "owner": row["key__owner__username"],
            "model": row["model"],
            "requests": row["requests_sum"],
            "prompt_tokens": row["prompt_sum"],
            "completion_tokens": row["completion_sum"],
        }
        for row in rows
    ]
