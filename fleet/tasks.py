from datetime import datetime

from celery import shared_task

from catalog.models import Model

from . import capacity, footprint
from .reconciler import reconcile_pass


@shared_task(ignore_result=True, soft_time_limit=90, time_limit=120)
def reconcile(kicked_at: str | None = None) -> None:
    """One reconcile pass; a pass already running elsewhere makes this one a no-op, and so does
    one that started after the change that kicked this one (`kicked_at`, ISO 8601), or, for
    beat's periodic pass (no `kicked_at`), the last pass having been too recent
    (fleet.reconciler.reconcile_wanted)."""
    if kicked_at is None:
        reconcile_pass(periodic=True)
        return
    try:
        when = datetime.fromisoformat(kicked_at)
    except (TypeError, ValueError):
        when = None
    reconcile_pass(kicked_at=when)


@shared_task(ignore_result=True, soft_time_limit=50, time_limit=60)
def sample_capacity() -> None:
    """Each node's capacity and reserved, for the Nodes page's chart; idempotent per minute."""
    capacity.sample()


@shared_task(ignore_result=True, soft_time_limit=50, time_limit=60)
def forget_unused_files() -> None:
    """Drop the GGUF header facts that no model uses any more (fleet.footprint.forget_unused)."""
    footprint.forget_unused(Model.objects.only("source", "sha256", "previous"))
