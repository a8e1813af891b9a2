from celery import shared_task


@shared_task(ignore_result=True, soft_time_limit=3600, time_limit=3700)
def run_fetch(fetch_id: int) -> None:
    """Bring a fetch's files into the mirror; a fetch another worker is running is left alone."""
    from .mirror import run_fetch as fetch

    fetch(fetch_id)


@shared_task(ignore_result=True, soft_time_limit=60, time_limit=90)
def advance_rollouts() -> None:
    from .updates import advance_rollouts as advance

    advance()


@shared_task(ignore_result=True, soft_time_limit=600, time_limit=660)
def check_updates() -> None:
    """Ask the registry whether served models have newer files (mirror.update_check)."""
    from .updates import check_updates as check

    check()
