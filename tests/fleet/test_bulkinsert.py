"""New replicas written with COPY on PostgreSQL (core.bulkinsert): the rows are those
bulk_create writes, and the reconciler's pass uses it."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import AuditEntry, Model
from core.bulkinsert import insert_many
from fleet.models import Node, Replica, hash_token
from fleet.reconciler import reconcile_pass

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]

# Text COPY has its own escapes (backslash, tab, newline) and JSON its own: both in a value.
AWKWARD = 'tab\there, line\nbreak, back\\slash, "quotes", \\N, ünïcödé, \u2028, end\\'


def _rows(model: Model, node: Node, count: int, now: datetime) -> list[Replica]:
    shared = {"source": AWKWARD, "adapters": [{"name": "a", "scale": 0.5}], "n": None}
    return [
        Replica(
            model=model if n % 3 else None,
            model_name=f"m-{n}",
            node=node,
            profile="cpu" if n % 2 else AWKWARD[:50],
            memory_gb=1.25 * n,
            cores=0.5,
            gpus=n % 2,
            gpu_memory_gb=0,
            devices=[n, n + 1] if n % 2 else [],
            spec=shared,
            spec_key=f"{n:064x}",
            state=Replica.STARTING,
            message=AWKWARD if n % 2 else "",
            port=None if n % 2 else 41000 + n,
            engine_metrics={"tokens_per_second": 1.5, "text": AWKWARD} if n % 2 else {},
            engine_metrics_at=now if n % 2 else None,
            withdrawn_at=None,
            created_at=now - timedelta(microseconds=n),
            ready_at=None,
            state_changed_at=now,
        )
        for n in range(count)
    ]


def _written(ids: list[uuid.UUID]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in row.items() if k != "id"}
        for row in Replica.objects.filter(pk__in=ids).order_by("model_name").values()
    ]


def test_the_rows_inserted_are_the_rows_bulk_create_inserts(fleet: Any) -> None:
    model = fleet.add("m", min_replicas=0, max_replicas=0)
    node = Node.objects.create(name="n1", token_hash=hash_token("t1"))
    now = timezone.now()
    copied, created = _rows(model, node, 12, now), _rows(model, node, 12, now)

    insert_many(Replica, copied)
    Replica.objects.bulk_create(created)

    assert len(_written([r.pk for r in copied])) == 12
    assert _written([r.pk for r in copied]) == _written([r.pk for r in created])
    assert Replica.objects.get(pk=copied[1].pk).message == AWKWARD
    # Left as bulk_create leaves its rows: saved, so that a save() updates rather than inserts.
    copied[0].message = "changed"
    copied[0].save()
    assert Replica.objects.get(pk=copied[0].pk).message == "changed"
    assert [r._state.adding for r in copied] == [r._state.adding for r in created]


def test_rows_needing_what_only_a_save_or_the_database_gives_are_refused() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("bulk_create writes them elsewhere, and sets them")
    # AuditEntry.at is stamped as the row is saved (auto_now_add), which COPY would not do.
    with pytest.raises(ValueError, match="set on save"):
        insert_many(AuditEntry, [AuditEntry(pk=10**9, action="x")])
    # A key the database would give (bulk_create reads it back; COPY cannot).
    with pytest.raises(ValueError, match="no primary key"):
        insert_many(AuditEntry, [AuditEntry(action="x")])
    assert not AuditEntry.objects.filter(action="x").exists()


def test_a_pass_placing_replicas_sends_no_insert_of_replicas_on_postgresql(fleet: Any) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("COPY is PostgreSQL's")
    now = timezone.now()
    Node.objects.bulk_create(
        Node(
            name=f"n{i}",
            token_hash=hash_token(f"t{i}"),
            memory_gb=8,
            cores=8,
            last_heartbeat=now,
        )
        for i in range(5)
    )
    fleet.add("m", min_replicas=20, max_replicas=20)

    with CaptureQueriesContext(connection) as queries:
        report = reconcile_pass()

    assert len(report.started) == 20
    assert Replica.objects.filter(model_name="m").count() == 20
    inserts = [
        q["sql"] for q in queries.captured_queries if 'INSERT INTO "fleet_replica"' in q["sql"]
    ]
    assert inserts == []
    assert set(Replica.objects.values_list("node__name", flat=True)) == {f"n{i}" for i in range(5)}
