"""A canary update, as the gateway sees it: the share of a model's requests its new revision
gets, and the figures per revision that the control plane judges it by.

While a canary runs (catalog.models.canary_routing), each request for the model draws once:
below `percent` it goes to the replicas of the new revision, otherwise to the others. When one
side has no ready replica the other takes everything, as without a canary: a request is never
refused because of the split. Fallbacks are not split (they serve another model).

Every answer is counted under the revision of the replica that gave it (gateway.traffic), so the
check (registry.canary.check_canaries, run by gateway.tasks.check_canaries with this module's
figures per revision) compares the two revisions on the same requests the clients saw; while the
canary runs they are also counted per key (registry.models.CanaryKeyMinute, which the check
reads itself), so that a key whose requests fail on both revisions alike cannot pass its
failures off as the new revision's (registry.canary.judge).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime

from registry import canary as registry_canary

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


def check_canaries() -> None:
    """One check of every canary under way (registry.canary.check_canaries) on the figures per
    revision this gateway writes: the registry, below the gateway, cannot read them itself."""
    registry_canary.check_canaries(revision_figures=_figures)


def _figures(names: list[str], since: datetime) -> dict[str, registry_canary.RevisionFigures]:
    return {
        revision: registry_canary.RevisionFigures(
            requests=seen.requests, errors=seen.server_errors, seconds=seen.seconds
        )
        for revision, seen in revision_figures(names, since).items()
    }
