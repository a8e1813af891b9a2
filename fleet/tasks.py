from celery import shared_task

from .reconciler import reconcile_pass


@shared_task(ignore_result=True, soft_time_limit=90, time_limit=120)
def reconcile() -> None:
    """One reconcile pass; a pass already running elsewhere makes this one a no-op."""
    reconcile_pass()
