"""The registry's part in catalog changes."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from catalog.models import Model
from catalog.signals import model_added

from .mirror import origin_for_source


@receiver(model_added)
def record_origin(sender: Any, *, model: Model, **kwargs: Any) -> None:
    """A model added by a mirror URL follows the registry repository its files came from."""
    if model.origin is None:
        origin = origin_for_source(model.source)
        if origin is not None:
            model.origin = origin
            model.save(update_fields=["origin"])
