"""The registry's part in catalog changes."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from catalog.models import Model
from catalog.signals import catalog_changed, model_added
from fleet.models import Replica
from fleet.signals import replica_state_changed
from llmgw.tracing import continued, enabled

from .mirror import origin_for_source
from .models import Rollout
from .queue import queue_now


@receiver(model_added)
def record_origin(sender: Any, *, model: Model, **kwargs: Any) -> None:
    """A model added by a mirror URL follows the registry repository its files came from."""
    if model.origin is None:
        origin = origin_for_source(model.source, model.mmproj, model.files)
        if origin is not None:
            model.origin = origin
            model.save(update_fields=["origin"])


@receiver(catalog_changed)
def clean_after_removal(sender: Any, *, names: list[str], **kwargs: Any) -> None:
    """A removed model's files leave the mirror now, not at the end of the next rollout: they
    count against their owner's serve quota (registry.quota) until they are gone."""
    if Model.objects.filter(name__in=names).count() < len(set(names)):
        queue_now("registry.tasks.clean_mirror")


@receiver(replica_state_changed)
def trace_replica_in_rollout(sender: Any, *, replica: Replica, before: str, **kwargs: Any) -> None:
    """A replica of a model under a rollout changed state (a node's heartbeat said so): a span of
    the rollout's trace, linked to the heartbeat's own. Nothing is read with tracing off."""
    if not enabled() or replica.model_id is None:
        return
    trace = (
        Rollout.objects.filter(model_id=replica.model_id)
        .active()
        .values_list("trace", flat=True)
        .first()
    )
    attributes = {
        "llmgw.replica": str(replica.pk),
        "llmgw.node": replica.node.name if replica.node_id else "",
        "llmgw.replica.state": replica.state,
        "llmgw.replica.before": before,
        "llmgw.replica.message": replica.message[:500],
    }
    with continued(trace or "", f"replica {replica.state}", attributes, link_current=True):
        pass
