"""What the catalog tells the apps above it, so that it never has to import them."""

from django.dispatch import Signal

# Sent with the names of the models that changed, after the transaction commits, so that the
# fleet can act on it at once.
catalog_changed = Signal()

# Sent with the new model (`model`) inside the add's transaction, before its audit entry: a
# source in the mirror has an origin there that the registry app fills in.
model_added = Signal()
