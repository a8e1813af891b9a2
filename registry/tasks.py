"""The registry's Celery tasks: each takes ids, calls the module that does the work, and is
queued by name (registry.queue), so nothing imports this module but the worker."""

from celery import shared_task

from . import fetches, mirror, rollouts, updates


@shared_task(ignore_result=True, soft_time_limit=3600, time_limit=3700)
def run_fetch(fetch_id: int) -> None:
    """Bring a fetch's files into the mirror; a fetch another worker is running is left alone."""
    fetches.run_fetch(fetch_id)


@shared_task(ignore_result=True, soft_time_limit=60, time_limit=90)
def advance_rollouts() -> None:
    fetches.release_abandoned()  # first, so that the rollouts' pass finds them queued
    rollouts.advance_rollouts()
    fetches.resume_interrupted()


@shared_task(ignore_result=True, soft_time_limit=600, time_limit=660)
def check_updates() -> None:
    """Ask the registry whether served models have newer files (mirror.update_check)."""
    updates.check_updates()


@shared_task(ignore_result=True, soft_time_limit=600, time_limit=660)
def clean_mirror() -> None:
    """Delete the mirror's files nothing refers to (queued when a model is removed)."""
    mirror.clean_mirror()
