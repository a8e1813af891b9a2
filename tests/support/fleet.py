"""Drives the control plane the way node agents do, for tests of the fleet without real agents."""

from __future__ import annotations

from typing import Any

from catalog.services import model_add
from core.actor import Actor
from fleet.models import Node, Replica
from fleet.services import node_add, node_heartbeat
from tests.factories import definition


class Fleet:
    """Drives the control plane the way agents do: heartbeats that report replica states."""

    def __init__(self, staff: Any, owner: Any) -> None:
        self.staff = Actor.for_user(staff, "api")
        self.owner = Actor.for_user(owner, "api")
        self.tokens: dict[str, str] = {}

    def node(self, name: str, memory_gb: float = 8, cores: float = 4, gpus: int = 0) -> Node:
        node, token = node_add(actor=self.staff, name=name)
        self.tokens[name] = token
        self.beat(name, memory_gb=memory_gb, cores=cores, gpus=gpus)
        return Node.objects.get(pk=node.pk)

    def beat(
        self,
        name: str,
        *,
        states: dict[str, str] | None = None,
        memory_gb: float | None = None,
        cores: float | None = None,
        gpus: int = 0,
    ) -> dict[str, Any]:
        """One heartbeat from node `name`; replicas it was told to run report `states` (default ready)."""
        node = Node.objects.get(name=name)
        wanted = Replica.objects.filter(node=node)
        report = {
            "capacity": {
                "memory_gb": node.memory_gb if memory_gb is None else memory_gb,
                "cores": node.cores if cores is None else cores,
                "gpus": gpus or node.gpus,
                "gpu_memory_gb": 0,
            },
            "replicas": [
                {
                    "id": str(r.pk),
                    "state": (states or {}).get(str(r.pk), "ready"),
                    "port": 41000 + i,
                    "message": "",
                }
                for i, r in enumerate(wanted)
                if states is None or str(r.pk) in states or r.state != "pending"
            ],
        }
        return node_heartbeat(node=node, report=report, interval=2)

    def add(self, name: str, **overrides: Any) -> Any:
        return model_add(
            actor=self.owner, definition=_clean(definition(name, **overrides)), source_check=False
        )

    def replicas(self, model: str, *, active: bool = True) -> list[Replica]:
        query = Replica.objects.filter(model_name=model).select_related("node")
        if active:
            query = query.filter(withdrawn_at__isnull=True)
        return list(query.order_by("created_at"))


def _clean(data: dict[str, Any]) -> dict[str, Any]:
    from catalog.definitions import clean_definition

    return clean_definition(data)
