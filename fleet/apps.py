from __future__ import annotations

from typing import TYPE_CHECKING, cast

from django.apps import AppConfig, apps

if TYPE_CHECKING:
    from .liveness import Liveness
    from .receivers import Kicks
    from .reconciler import SilentNodes
    from .services import FleetSize


class FleetConfig(AppConfig):
    """The fleet app, and the state it keeps in each process between requests and passes, made
    once the process's apps are ready: the web's renewals waiting to be written and its count of
    the fleet (fleet.api), a worker's log of silent nodes (fleet.tasks), and the kicks of a
    reconcile pass that the catalog's and the fleet's changes send."""

    name = "fleet"
    verbose_name = "Fleet"
    default_auto_field = "django.db.models.BigAutoField"

    liveness: Liveness
    fleet_size: FleetSize
    silent_nodes: SilentNodes
    kicks: Kicks

    def ready(self) -> None:
        # Here, not at the top: apps.py is imported while the apps load, before models exist.
        from .liveness import Liveness
        from .receivers import Kicks
        from .reconciler import SilentNodes
        from .services import FleetSize

        self.liveness = Liveness()
        self.fleet_size = FleetSize()
        self.silent_nodes = SilentNodes()
        self.kicks = Kicks()
        self.kicks.connect()


def this_process() -> FleetConfig:
    """The fleet app of this process, with the state it keeps (see FleetConfig)."""
    return cast(FleetConfig, apps.get_app_config("fleet"))
