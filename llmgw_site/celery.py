"""The Celery app: `celery -A llmgw_site worker` and `celery -A llmgw_site beat`."""

import os

from celery import Celery
from celery.signals import beat_init, worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

# Every task is a PeriodicTask: a periodic send runs once, and only while it is the latest
# (llmgw_site.beat).
app = Celery("llmgw", task_cls="llmgw_site.beat:PeriodicTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def _apply_config_on_worker_start(**_: object) -> None:
    # Here: startup reaches models, and this module is loaded before Django's apps.
    from .startup import apply_config_on_start

    apply_config_on_start("worker")


@beat_init.connect
def _apply_config_on_beat_start(**_: object) -> None:
    # Here: startup reaches models, and this module is loaded before Django's apps.
    from .startup import apply_config_on_start

    apply_config_on_start("beat")
