"""The figures per revision that a canary update is judged by: what the gateway answered for
each revision (access.traffic), read for registry.canary.check_canaries, which cannot read them
itself from below. The split of requests between revisions is the data plane's (gateway.canary).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from registry import canary as registry_canary

from .models import TrafficMinute
from .traffic import MINUTE, Figures


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
