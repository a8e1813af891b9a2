"""Kick a reconcile pass as soon as the catalog or the fleet changes, instead of waiting for beat."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.dispatch import receiver
from django.utils import timezone

from catalog.signals import catalog_changed

from .signals import fleet_changed
from .tasks import reconcile

log = logging.getLogger("llmgw.reconciler")


@receiver(catalog_changed)
@receiver(fleet_changed)
def kick_reconcile(sender: Any, **kwargs: Any) -> None:

    if not settings.LLMGW_KICK_RECONCILE:
        return
    try:
        # After the commit (the signals are sent on_commit): any pass that starts later sees
        # the change, and the kicks of a burst of changes make one pass, not one each.
        reconcile.delay(kicked_at=timezone.now().isoformat())
    except Exception as exc:  # the broker being down must not fail the change itself
        log.warning("could not queue a reconcile pass (%s); beat will run one shortly", exc)
