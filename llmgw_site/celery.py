"""The Celery app: `celery -A llmgw_site worker` and `celery -A llmgw_site beat`."""

import os

from celery import Celery
from celery.signals import beat_init, worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

app = Celery("llmgw")
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
