from django.dispatch import Signal

# Sent after a fleet change commits (a node changed, a replica became ready or failed).
fleet_changed = Signal()

# Sent when a node's heartbeat changes a replica's state (replica=, before=: its state until
# then), inside the heartbeat's request: the registry traces it as a step of a rollout under way.
replica_state_changed = Signal()
