"""Queueing the registry's tasks by name, so that no module here imports the Celery app."""

from __future__ import annotations

import logging
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import transaction

log = logging.getLogger("registry.queue")


def queue_now(task_name: str, *args: Any) -> None:
    """Queue a task; beat runs the same work shortly if the broker is away."""
    if not settings.LLMGW_KICK_RECONCILE:
        return
    try:
        current_app.send_task(task_name, args=args)
    except Exception as exc:
        log.warning("could not queue %s (%s); beat will pick it up", task_name, exc)


def queue_on_commit(task_name: str, *args: Any) -> None:
    """Queue a task once the current transaction commits (never for a rolled-back change)."""
    transaction.on_commit(lambda: queue_now(task_name, *args))
