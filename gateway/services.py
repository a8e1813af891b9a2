"""Writes for gateway keys: create, revoke, and the record of a key's use.

The API, the CLI (through the API) and the admin's revoke action all call
these, so they cannot disagree about who may do what.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from catalog import services as catalog_services
from catalog.errors import CatalogError, conflict, forbidden
from catalog.services import Actor

from .models import GatewayKey, hash_key
from .routing import Entry

KEY_PREFIX = "llmgw-"
# What is kept of a key in clear, to tell keys apart in listings: the fixed
# prefix and six of its 43 random characters (36 of 256 random bits; the other
# 220 are still far beyond guessing).
SHOWN_CHARS = len(KEY_PREFIX) + 6
KEY_NAME_MAX = 100


def key_create(*, actor: Actor, name: str) -> tuple[GatewayKey, str]:
    """A new key owned by the actor; returns it and the key itself, which is shown only this once."""
    if actor.user is None:
        raise forbidden("Only a user can own a gateway key; log in first.")
    name = (name or "").strip()
    if not name or len(name) > KEY_NAME_MAX:
        raise CatalogError(
            f"Give the key a name of 1 to {KEY_NAME_MAX} characters that says what it is for "
            "(say, the application that will use it).",
            code="invalid",
        )
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        # The owner's row is locked while the keys are counted, so two creates at once
        # cannot both see room for one more.
        get_user_model().objects.select_for_update().filter(pk=actor.user.pk).first()
        refuse_past_key_limit(actor.user)
        key = GatewayKey.objects.create(
            name=name, owner=actor.user, prefix=secret[:SHOWN_CHARS], key_hash=hash_key(secret)
        )
    return key, secret


def refuse_past_key_limit(user: Any) -> None:
    """Every gateway process holds every active key in memory: one user's keys are bounded."""
    limit = settings.LLMGW_MAX_KEYS_PER_USER
    active = GatewayKey.objects.filter(owner=user, revoked_at__isnull=True).count()
    if active >= limit:
        raise conflict(
            f"You have {active} active gateway {'key' if active == 1 else 'keys'}, and one user "
            f"may hold at most {limit}. "
            "Revoke the keys you no longer use (`llmgw ctl keys` lists them, "
            "`llmgw ctl key revoke ID` revokes one), or ask the operator to raise "
            "LLMGW_MAX_KEYS_PER_USER.",
            code="too_many_keys",
        )


def key_revoke(*, actor: Actor, key_id: int) -> GatewayKey:
    """Revoke a key (its owner or staff); requests with it are refused from now on.

    Revoking a revoked key changes nothing and is not an error: the caller wanted
    the key not to work, and it does not.
    """
    with transaction.atomic():
        key = _key_for_change(actor, key_id)
        if key.revoked_at is None:
            key.revoked_at = timezone.now()
            key.revoked_by = actor.user
            key.save(update_fields=["revoked_at", "revoked_by"])
    return key


def _key_for_change(actor: Actor, key_id: int) -> GatewayKey:
    key = GatewayKey.objects.select_for_update().select_related("owner").filter(pk=key_id).first()
    # Someone else's key is reported as missing, not forbidden, so that key ids
    # do not tell outsiders which keys exist.
    mine = key is not None and (actor.is_staff or key.owner_id == getattr(actor.user, "pk", None))
    if key is None or not mine:
        raise CatalogError(
            f"There is no gateway key {key_id} of yours; `llmgw ctl keys` lists them.",
            code="not_found",
            status=404,
        )
    return key


def keys_used(key_ids: list[int]) -> None:
    """Record that these keys were just used (the gateway batches this, see gateway.state)."""
    GatewayKey.objects.filter(pk__in=key_ids).update(last_used_at=timezone.now())


# -- the idle clock -----------------------------------------------------------------------

# An on-demand model is stopped once nobody has asked for it for its idle timeout.
# Every request counts as asking, but writing that down on every request would
# make the database the gateway's bottleneck: each process writes it at most
# this often per model (and a quarter of the idle timeout when that is shorter,
# so that a short timeout still sees several refreshes before it runs out).
DEMAND_REFRESH_SECONDS = 5.0
# With nothing ready, the write also wakes the reconciler, so it is made sooner.
DEMAND_WAKE_SECONDS = 1.0

_demand_lock = threading.Lock()
_demand_written: dict[str, float] = {}


def model_asked_for(entry: Entry, *, nothing_ready: bool) -> bool:
    """Restart an on-demand model's idle clock (and load it when nothing runs); True if written."""
    if not entry.on_demand:
        return False  # only on-demand models have an idle clock
    from catalog.config import current_config

    idle = entry.idle_timeout or current_config().default_idle_timeout
    every = DEMAND_WAKE_SECONDS if nothing_ready else min(DEMAND_REFRESH_SECONDS, idle / 4)
    now = time.monotonic()
    with _demand_lock:
        last = _demand_written.get(entry.model)
        if last is not None and now - last < every:
            return False
        _demand_written[entry.model] = now
    try:
        catalog_services.model_demand(name=entry.model)
    except CatalogError:
        return False  # removed since the catalog was read: the request gets its 404 next time
    return True


def forget_demand() -> None:
    """For tests: forget when each model's clock was last written by this process."""
    with _demand_lock:
        _demand_written.clear()
