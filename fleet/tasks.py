from datetime import UTC, datetime, timedelta

from celery import shared_task
from django.apps import apps
from django.utils import timezone

from catalog.models import Model

from . import capacity, footprint
from .reconciler import LEASE_SECONDS, SilentNodes, kick_wait, reconcile_pass, running_pass_left


@shared_task(ignore_result=True, soft_time_limit=90, time_limit=120)
def reconcile(kicked_at: str | None = None) -> None:
    """One reconcile pass; a pass already running elsewhere makes this one a no-op, and so does
    one that started after the change that kicked this one (`kicked_at`, ISO 8601), or, for
    beat's periodic pass (no `kicked_at`), the last pass having been too recent
    (fleet.reconciler.reconcile_wanted)."""
    if kicked_at is None:
        reconcile_pass(periodic=True, silent=_silent_nodes())
        return
    try:
        when = datetime.fromisoformat(kicked_at)
    except (TypeError, ValueError):
        when = None
    if when is not None and timezone.is_naive(when):
        when = when.replace(tzinfo=UTC)
    eager = reconcile.app.conf.task_always_eager  # would ask again at once, in this same call
    if when is not None and not eager:
        wait = kick_wait(when, timezone.now())
        if wait > 0:
            # Too soon after the last pass (KICK_DUTY_FACTOR): asked again when it may run. The
            # kicks queued meanwhile are served by that one pass (reconcile_wanted).
            reconcile.apply_async(kwargs={"kicked_at": kicked_at}, countdown=wait)
            return
    report = reconcile_pass(kicked_at=when, silent=_silent_nodes())
    if report.busy and when is not None and timezone.now() - when < BUSY_GIVE_UP and not eager:
        # Another pass holds the lease, and it may have started before this change committed
        # (a pass over thousands of replicas takes seconds): dropped, the change would wait for
        # the periodic pass, DUTY_FACTOR times a long pass later. Asked again when the running
        # pass is likely done (BUSY_RETRY_SECONDS to BUSY_RETRY_MAX on); a pass that started
        # after the change serves it then (reconcile_wanted).
        wait = max(BUSY_RETRY_SECONDS, min(running_pass_left(timezone.now()), BUSY_RETRY_MAX))
        reconcile.apply_async(kwargs={"kicked_at": kicked_at}, countdown=wait)


def _silent_nodes() -> SilentNodes:
    """The silent nodes this worker last logged, which the fleet app keeps across its passes
    (fleet.apps.FleetConfig; read through Django's registry, as fleet.apps imports this module
    by its receivers)."""
    return apps.get_app_config("fleet").silent_nodes  # type: ignore[attr-defined]


# A kicked pass that found another holding the lease asks again once that pass is likely done,
# at least this long after and at most BUSY_RETRY_MAX, for at most as long as a lease lasts (a
# pass that died holding it: the periodic pass takes over then).
BUSY_RETRY_SECONDS = 1.0
BUSY_RETRY_MAX = 30.0
BUSY_GIVE_UP = timedelta(seconds=LEASE_SECONDS)


@shared_task(ignore_result=True, soft_time_limit=50, time_limit=60)
def sample_capacity() -> None:
    """Each node's capacity and reserved, for the Nodes page's chart; idempotent per minute."""
    capacity.sample()


@shared_task(ignore_result=True, soft_time_limit=50, time_limit=60)
def forget_unused_files() -> None:
    """Drop the GGUF header facts that no model uses any more (fleet.footprint.forget_unused)."""
    footprint.forget_unused(
        Model.objects.only("source", "sha256", "previous", *footprint.FILE_FIELDS)
    )
