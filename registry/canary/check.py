"""The canary check: every canary under way moved on and, once watching, judged on the figures.

Beat runs it every LLMGW_CANARY_CHECK_SECONDS through the task access.tasks.check_canaries
(the name beat schedules and queued messages use). The figures per revision are the gateway's
own table (access.models.TrafficMinute, written by its traffic book, folded and read by its
traffic pages), which the registry, below the gateway, may not import: the gateway passes its
reader in (`revision_figures`). Why not move the table down here: it is the gateway's record of
all its traffic, of which the canary reads a small part, and moving it would mean a migration
of a live table. The per-key figures the check also weighs are the registry's own
(registry.models.CanaryKeyMinute, read by selectors.key_figures).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from core.dbclock import database_now

from .rule import RevisionFigures
from .selectors import active_canaries, key_figures, names_counted
from .services import advance_canary, check_canary

# What the gateway answered for these names per revision, from the minute of `since` on.
RevisionFiguresReader = Callable[[list[str], datetime], dict[str, RevisionFigures]]

# A canary counts the gateway's figures from this long before its window opened, less what
# they held then (its baseline). The gateway stamps its minutes by its own wall clock: counted
# from the window's start, the answers of a gateway whose clock stepped back (or runs behind the
# worker's) fell in minutes before it and were never counted. Up to this much of a step, or
# of a gateway's lag, they still are; the window's length is the database's clock's.
COUNTED_CLOCK_SLACK = timedelta(minutes=10)


def check_canaries(*, revision_figures: RevisionFiguresReader) -> None:
    """Move every canary under way on (its window starts when its replica is ready, with what the
    figures held then as its baseline), then judge each one that was watching already on the
    figures of its model's names (the model and its adapters). Idempotent: each step reads its
    state under the catalog lock. The window is measured by the database's clock."""
    now = database_now()
    counted_from = min(now, datetime.now(UTC)) - COUNTED_CLOCK_SLACK
    started = set()
    for model in active_canaries():
        waiting = (model.canary or {}).get("state") == "waiting"
        baseline = revision_figures(names_counted(model), counted_from) if waiting else None
        if advance_canary(model, baseline=baseline, now=now, counted_from=counted_from):
            started.add(model.pk)
    for model in active_canaries():
        canary = model.canary or {}
        if canary.get("state") != "watching" or model.pk in started:
            continue
        since = datetime.fromisoformat(canary.get("counted_from") or canary["started_at"])
        names = names_counted(model)
        keys = key_figures(names, (canary["from_revision"], canary["revision"]), since)
        check_canary(model, revision_figures(names, since), keys=keys, now=now)
