from celery import shared_task

from . import canary, traffic


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=180)
def fold_traffic() -> dict[str, int]:
    """Fold old minutes of traffic into hours and delete what is past keeping; idempotent."""
    return traffic.fold()


@shared_task(ignore_result=True, soft_time_limit=50, time_limit=60)
def check_canaries() -> None:
    """One check of every canary update under way (LLMGW_CANARY_CHECK_SECONDS); idempotent."""
    canary.check_canaries()
