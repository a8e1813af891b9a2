"""The Celery app: `celery -A llmgw_site worker` and `celery -A llmgw_site beat`."""

import os

from celery import Celery
from celery.signals import beat_init, worker_init, worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

# Every task is a PeriodicTask: a periodic send runs once, and only while it is the latest
# (llmgw_site.beat).
app = Celery("llmgw", task_cls="llmgw_site.beat:PeriodicTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# What the worker's pool processes and beat trace when OTEL_EXPORTER_OTLP_ENDPOINT is set
# (llmgw.tracing): the tasks, and what they send to the database, Redis and over HTTP.
TRACED = ("celery", "requests", "psycopg", "redis")


@worker_process_init.connect
def _start_tracing_in_pool_process(**_: object) -> None:
    # In each pool process, after the fork: the tasks run there.
    from llmgw.tracing import start_tracing

    start_tracing("llmgw-worker", TRACED)


@worker_init.connect
def _apply_config_on_worker_start(**_: object) -> None:
    # Here: startup reaches models, and this module is loaded before Django's apps.
    from .startup import apply_config_on_start

    apply_config_on_start("worker")


@beat_init.connect
def _apply_config_on_beat_start(**_: object) -> None:
    from llmgw.tracing import start_tracing

    start_tracing("llmgw-beat", TRACED)
    # Here: startup reaches models, and this module is loaded before Django's apps.
    from .startup import apply_config_on_start

    apply_config_on_start("beat")
