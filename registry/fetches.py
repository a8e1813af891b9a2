"""A fetch from start to end: its files into the mirror, then what was waiting for them (the
model a `serve` adds, the rollout that swaps to them). This is what the worker runs."""

from __future__ import annotations

from . import mirror
from .models import Fetch
from .rollouts import advance_rollouts
from .updates import finish_serve


def run_fetch(fetch_id: int) -> None:
    """Safe to run twice, or beside another worker: a fetch is claimed before it is run."""
    if not mirror.download(fetch_id):
        return
    fetch = Fetch.objects.get(pk=fetch_id)
    if fetch.serve_definition is not None:
        finish_serve(fetch)
    advance_rollouts()
