from celery import shared_task

from catalog.models import Model

from . import capacity, footprint
from .reconciler import reconcile_pass


@shared_task(ignore_result=True, soft_time_limit=90, time_limit=120)
def reconcile() -> None:
    """One reconcile pass; a pass already running elsewhere makes this one a no-op."""
    reconcile_pass()


@shared_task(ignore_result=True, soft_time_limit=50, time_limit=60)
def sample_capacity() -> None:
    """Each node's capacity and reserved, for the Nodes page's chart; idempotent per minute."""
    capacity.sample()


@shared_task(ignore_result=True, soft_time_limit=50, time_limit=60)
def forget_unused_files() -> None:
    """Drop the GGUF header facts that no model uses any more (fleet.footprint.forget_unused)."""
    footprint.forget_unused(Model.objects.only("source", "sha256", "previous"))
