"""Kick a reconcile pass as soon as the catalog or the fleet changes, instead of waiting for beat."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.dispatch import receiver
from django.utils import timezone

from catalog.signals import catalog_changed

from .signals import fleet_changed
from .tasks import reconcile

log = logging.getLogger("llmgw.reconciler")


# Kicks of one process within this many seconds are one task: the first queues a pass to run
# at the window's end, which sees every change committed before it. Thousands of nodes reporting
# their replicas ready at once then queue a few passes, not one task each.
KICK_WINDOW_SECONDS = 0.5
_window = threading.Lock()
_window_ends = [0.0]  # time.monotonic() at which the queued kick's window ends


@receiver(catalog_changed)
@receiver(fleet_changed)
def kick_reconcile(sender: Any, **kwargs: Any) -> None:
    if not settings.LLMGW_KICK_RECONCILE:
        return
    with _window:
        clock = time.monotonic()
        if clock < _window_ends[0]:
            return  # the kick queued in this window runs after this change committed
        _window_ends[0] = clock + KICK_WINDOW_SECONDS
    try:
        # The signals are sent on_commit: a pass that starts after the window's end sees this
        # change and every other of the window (fleet.reconciler.reconcile_wanted).
        until = timezone.now() + timedelta(seconds=KICK_WINDOW_SECONDS)
        reconcile.apply_async(
            kwargs={"kicked_at": until.isoformat()}, countdown=KICK_WINDOW_SECONDS
        )
    except Exception as exc:  # the broker being down must not fail the change itself
        with _window:
            _window_ends[0] = 0.0  # the next change tries again
        log.warning("could not queue a reconcile pass (%s); beat will run one shortly", exc)
