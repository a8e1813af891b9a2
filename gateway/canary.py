"""A canary update, as the gateway sees it: the share of a model's requests its new revision
gets, and the figures per revision that the control plane judges it by.

While a canary runs (catalog.models.canary_routing), each request for the model draws once:
below `percent` it goes to the replicas of the new revision, otherwise to the others. When one
side has no ready replica the other takes everything, as without a canary: a request is never
refused because of the split. Fallbacks are not split (they serve another model).

Every answer is counted under the revision of the replica that gave it (gateway.traffic), so the
check (registry.canary, run by gateway.tasks.check_canaries) compares the two revisions on the
same requests the clients saw; while the canary runs they are also counted per key
(registry.models.CanaryKeyMinute), so that a key whose requests fail on both revisions alike
cannot pass its failures off as the new revision's (registry.canary.judge).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from django.db.models import Sum

from registry import canary as registry_canary
from registry.models import CanaryKeyMinute

from .models import TrafficMinute
from .routing import Entry, Serve
from .traffic import MINUTE, Figures


def share(decision: Serve, entry: Entry, draw: float) -> Serve:
    """The candidates a request may go to, given a draw in [0, 1)."""
    canary = entry.canary
    if canary is None or decision.fallback_from is not None:
        return decision
    new = tuple(c for c in decision.candidates if c.revision == canary.revision)
    old = tuple(c for c in decision.candidates if c.revision != canary.revision)
    if not new or not old:
        return decision
    return replace(decision, candidates=new if draw * 100 < canary.percent else old)


def revision_figures(names: Iterable[str], since: datetime) -> dict[str, Figures]:
    """What the gateway processes answered for these names per revision, from the minute of
    `since` on (written every traffic.FLUSH_SECONDS); one query."""
    epoch = int(since.timestamp())
    start = datetime.fromtimestamp(epoch - epoch % MINUTE, UTC)
    fields = list(Figures().__dict__)
    rows = (
        TrafficMinute.objects.filter(model__in=list(names), span=MINUTE, start__gte=start)
        .exclude(revision="")
        .values_list("revision", *fields)
    )
    found: dict[str, Figures] = {}
    for revision, *values in rows:
        found.setdefault(revision, Figures()).add(dict(zip(fields, values, strict=True)))
    return found


def key_figures(
    names: Iterable[str], revisions: Iterable[str], since: datetime
) -> dict[int, dict[str, registry_canary.RevisionFigures]]:
    """What the gateway processes answered each key for these names on these revisions, from
    the minute of `since` on; one query, summed in the database (a row per key and revision)."""
    epoch = int(since.timestamp())
    start = datetime.fromtimestamp(epoch - epoch % MINUTE, UTC)
    rows = (
        CanaryKeyMinute.objects.filter(
            model__in=list(names), revision__in=list(revisions), start__gte=start
        )
        .values("key_id", "revision")
        .annotate(
            total_requests=Sum("requests"),
            total_errors=Sum("server_errors"),
            total_seconds=Sum("seconds"),
        )
        .order_by()
    )
    found: dict[int, dict[str, registry_canary.RevisionFigures]] = {}
    for row in rows:
        found.setdefault(row["key_id"], {})[row["revision"]] = registry_canary.RevisionFigures(
            requests=row["total_requests"] or 0,
            errors=row["total_errors"] or 0,
            seconds=row["total_seconds"] or 0.0,
        )
    return found


def check_canaries() -> None:
    """Move every canary under way on (its window starts when its replica is ready, with what the
    figures held then as its baseline), then judge each one that was watching already on the
    figures of its model's names (the model and its adapters)."""
    now = datetime.now(UTC)
    started = set()
    for model in registry_canary.active_canaries():
        baseline = _figures(model, now) if (model.canary or {}).get("state") == "waiting" else None
        if registry_canary.advance_canary(model, baseline=baseline, now=now):
            started.add(model.pk)
    for model in registry_canary.active_canaries():
        canary = model.canary or {}
        if canary.get("state") != "watching" or model.pk in started:
            continue
        since = datetime.fromisoformat(canary["started_at"])
        names = _names(model)
        keys = key_figures(names, (canary["from_revision"], canary["revision"]), since)
        registry_canary.check_canary(model, _figures(model, since), keys=keys)


def _names(model: Any) -> list[str]:
    """The names the gateway counts a model's answers under: the model and its adapters."""
    return [model.name, *(a["name"] for a in model.adapters)]


def _figures(model: Any, since: datetime) -> dict[str, registry_canary.RevisionFigures]:
    names = _names(model)
    return {
        revision: registry_canary.RevisionFigures(
            requests=seen.requests, errors=seen.server_errors, seconds=seen.seconds
        )
        for revision, seen in revision_figures(names, since).items()
    }
