"""A canary update's share of a model's requests, as the data plane routes them.

While a canary runs (catalog.models.canary_routing), each request for the model draws once:
below `percent` it goes to the replicas of the new revision, otherwise to the others. When one
side has no ready replica the other takes everything: a request is never refused because of the
split. Fallbacks are not split (they serve another model). The check that judges the revisions
is the control plane's (access.canary, registry.canary).
"""

from __future__ import annotations

from dataclasses import replace

from .routing import Entry, Serve


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
