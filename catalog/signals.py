"""Sent after a catalog change has committed, so that the fleet can act on it at once."""

from django.dispatch import Signal

# Sent with the names of the models that changed, after the transaction commits.
catalog_changed = Signal()
