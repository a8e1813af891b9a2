from django.dispatch import Signal

# Sent after a fleet change commits (a node changed, a replica became ready or failed).
fleet_changed = Signal()
