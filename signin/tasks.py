from dataclasses import asdict
from typing import Any

from celery import shared_task

from . import leavers


@shared_task(ignore_result=True, soft_time_limit=50, time_limit=60)
def check_members() -> dict[str, Any]:
    """Ask the provider about the people due a check (signin.leavers.check_members); idempotent."""
    return asdict(leavers.check_members())
