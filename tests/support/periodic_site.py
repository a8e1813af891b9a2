"""Settings with one more periodic task, `probe`, that writes each run down (periodic_probe), to
count a schedule's runs across control planes."""

from llmgw_site.settings import *  # noqa: F403
from llmgw_site.settings import CELERY_BEAT_SCHEDULE

PROBE_SECONDS = 2.0
CELERY_BEAT_SCHEDULE = {
    **CELERY_BEAT_SCHEDULE,
    "probe": {"task": "tests.support.periodic_probe.record", "schedule": PROBE_SECONDS},
}
CELERY_IMPORTS = ["tests.support.periodic_probe"]
