"""The registry's part in catalog changes."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from catalog.models import Model
from catalog.signals import catalog_changed, model_added

from .mirror import origin_for_source
from .queue import queue_now


@receiver(model_added)
def record_origin(sender: Any, *, model: Model, **kwargs: Any) -> None:
    """A model added by a mirror URL follows the registry repository its files came from."""
    if model.origin is None:
        origin = origin_for_source(model.source)
        if origin is not None:
            model.origin = origin
            model.save(update_fields=["origin"])


@receiver(catalog_changed)
def clean_after_removal(sender: Any, *, names: list[str], **kwargs: Any) -> None:
    """A removed model's files leave the mirror now, not at the end of the next rollout: they
    count against their owner's serve quota (registry.quota) until they are gone."""
    if Model.objects.filter(name__in=names).count() < len(set(names)):
        queue_now("registry.tasks.clean_mirror")
