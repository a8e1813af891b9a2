"""Kick a reconcile pass as soon as the catalog or the fleet changes, instead of waiting for beat."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from catalog.signals import catalog_changed

from .signals import fleet_changed
from .tasks import reconcile

log = logging.getLogger("llmgw.reconciler")


# Kicks of one process within this many seconds are one task: the first queues a pass to run
# at the window's end, which sees every change committed before it. Thousands of nodes reporting
# their replicas ready at once then queue a few passes, not one task each.
KICK_WINDOW_SECONDS = 0.5


class Kicks:
    """This process's kicks of a reconcile pass, one a KICK_WINDOW_SECONDS window: made with
    the fleet app (fleet.apps), which connects `kick_reconcile` to the catalog's and the
    fleet's changes (`connect`)."""

    def __init__(self) -> None:
        self.window_ends = 0.0  # time.monotonic() at which the queued kick's window ends
        self._lock = threading.Lock()

    def kick_reconcile(self, sender: Any, **kwargs: Any) -> None:
        if not settings.LLMGW_KICK_RECONCILE:
            return
        with self._lock:
            clock = time.monotonic()
            if clock < self.window_ends:
                return  # the kick queued in this window runs after this change committed
            self.window_ends = clock + KICK_WINDOW_SECONDS
        try:
            # The signals are sent on_commit: a pass that starts after the window's end sees
            # this change and every other of the window (fleet.reconciler.reconcile_wanted).
            until = timezone.now() + timedelta(seconds=KICK_WINDOW_SECONDS)
            reconcile.apply_async(
                kwargs={"kicked_at": until.isoformat()}, countdown=KICK_WINDOW_SECONDS
            )
        except Exception as exc:  # the broker being down must not fail the change itself
            with self._lock:
                self.window_ends = 0.0  # the next change tries again
            log.warning("could not queue a reconcile pass (%s); beat will run one shortly", exc)

    def connect(self) -> None:
        """Kick a pass at each change of the catalog or the fleet (once, however often called)."""
        catalog_changed.connect(self.kick_reconcile, dispatch_uid="fleet.kick_reconcile")
        fleet_changed.connect(self.kick_reconcile, dispatch_uid="fleet.kick_reconcile")
