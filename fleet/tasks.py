from celery import shared_task

from . import capacity
from .reconciler import reconcile_pass


@shared_task(ignore_result=True, soft_time_limit=90, time_limit=120)
def reconcile() -> None:
    """One reconcile pass; a pass already running elsewhere makes this one a no-op."""
    reconcile_pass()


@shared_task(ignore_result=True, soft_time_limit=50, time_limit=60)
def sample_capacity() -> None:
    """Each node's capacity and reserved, for the Nodes page's chart; idempotent per minute."""
    capacity.sample()
