"""Capacity over time: each node's capacity and what its replicas reserve, sampled every
minute by beat, for the Nodes page's chart.

Bounded: a day of minutes, then one sample in ten (every ten minutes) up to KEEP_DAYS, so a
node has at most 1,440 + 144 x 7 rows, whatever runs on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Count, Sum

from .models import CapacitySample, Node, Replica

KEEP_DAYS = 8
THIN_AFTER = timedelta(days=1)
THIN_TO_MINUTES = 10


def sample(now: datetime | None = None) -> int:
    """Write this minute's sample of every node (again, if it was written already)."""
    now = now or datetime.now(UTC)
    minute = now.replace(second=0, microsecond=0)
    reserved: dict[int, dict[str, Any]] = {
        row["node_id"]: dict(row)
        for row in Replica.objects.filter(withdrawn_at__isnull=True)
        .values("node_id")
        .annotate(memory=Sum("memory_gb"), cores=Sum("cores"), count=Count("id"))
        .order_by()
    }
    rows = []
    for node in Node.objects.filter(last_heartbeat__isnull=False).order_by():
        used: dict[str, Any] = reserved.get(node.pk, {})
        rows.append(
            CapacitySample(
                node=node.name,
                start=minute,
                memory_gb=node.memory_gb,
                memory_reserved_gb=used.get("memory") or 0,
                cores=node.cores,
                cores_reserved=used.get("cores") or 0,
                replicas=used.get("count") or 0,
            )
        )
    CapacitySample.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["node", "start"],
        update_fields=["memory_gb", "memory_reserved_gb", "cores", "cores_reserved", "replicas"],
    )
    thin(now)
    return len(rows)


def thin(now: datetime) -> None:
    CapacitySample.objects.filter(start__lt=now - timedelta(days=KEEP_DAYS)).delete()
    # Only the hour just past a day: earlier ones were thinned by earlier samples (a beat that
    # stopped for longer leaves some extra rows, still bounded by KEEP_DAYS).
    old = CapacitySample.objects.filter(
        start__lt=now - THIN_AFTER, start__gte=now - THIN_AFTER - timedelta(hours=1)
    ).values_list("id", "start")
    CapacitySample.objects.filter(
        id__in=[pk for pk, start in old if start.minute % THIN_TO_MINUTES]
    ).delete()


@dataclass
class ClusterSample:
    start: datetime
    memory_gb: float = 0.0
    memory_reserved_gb: float = 0.0
    cores: float = 0.0
    cores_reserved: float = 0.0


def cluster_series(length: timedelta, now: datetime | None = None) -> list[ClusterSample]:
    """Capacity and reserved summed over the nodes, per sampled minute, oldest first; one query."""
    now = now or datetime.now(UTC)
    totals: dict[datetime, ClusterSample] = {}
    for start, memory, memory_reserved, cores, cores_reserved in CapacitySample.objects.filter(
        start__gte=now - length
    ).values_list("start", "memory_gb", "memory_reserved_gb", "cores", "cores_reserved"):
        into = totals.setdefault(start, ClusterSample(start))
        into.memory_gb += memory
        into.memory_reserved_gb += memory_reserved
        into.cores += cores
        into.cores_reserved += cores_reserved
    return [totals[start] for start in sorted(totals)]
