"""The cheap heartbeat: renewals (POST /api/v1/node/renew), generations, the batched liveness write,
and the interval that grows with the fleet (fleet.services.node_renew, fleet.liveness)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from catalog.services import model_remove
from fleet import liveness, services
from fleet.liveness import Liveness
from fleet.models import Node, Replica
from fleet.reconciler import reconcile_pass
from tests.support.fleet import Fleet

pytestmark = [pytest.mark.django_db]

DIGEST = "a" * 64
OTHER = "b" * 64
REPORT = {"capacity": {"memory_gb": 8, "cores": 4}, "replicas": [], "report_digest": DIGEST}


def client(token: str) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return api


@pytest.fixture
def node(fleet: Fleet) -> tuple[Node, APIClient]:
    """A node that sent one whole report (with its digest) and acted on the answer."""
    fleet.node("n1")
    api = client(fleet.tokens["n1"])
    answer = api.post("/api/v1/node/heartbeat", REPORT, format="json").json()
    assert answer["generation"] == 0
    return Node.objects.get(name="n1"), api


def renew(api: APIClient, generation: int | None, digest: str = DIGEST) -> dict[str, Any]:
    response = api.post(
        "/api/v1/node/renew", {"generation": generation, "report_digest": digest}, format="json"
    )
    assert response.status_code == 200, response.content
    return response.json()


def test_a_renewal_with_the_current_generation_gets_nothing_changed_and_marks_the_node_alive(
    node: tuple[Node, APIClient],
) -> None:
    n1, api = node
    Node.objects.filter(pk=n1.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=10))
    before = Node.objects.get(pk=n1.pk).last_heartbeat
    answer = renew(api, 0)
    assert answer == {
        "node": "n1",
        "heartbeat_interval": 2,
        "report": "current",
        "changed": False,
        "generation": 0,
    }
    assert Node.objects.get(pk=n1.pk).last_heartbeat > before


def test_an_unchanged_renewal_reads_no_replica_and_writes_one_row(
    node: tuple[Node, APIClient], fleet: Fleet
) -> None:
    fleet.add("m", min_replicas=1, max_replicas=1)
    reconcile_pass()
    generation = Node.objects.get(name="n1").generation
    _, api = node
    renew(api, generation)  # warms the fleet count the interval is computed from
    with CaptureQueriesContext(connection) as queries:
        assert renew(api, generation)["changed"] is False
    statements = [q["sql"] for q in queries.captured_queries]
    assert not any("fleet_replica" in sql for sql in statements), statements
    writes = [sql for sql in statements if "UPDATE" in sql]
    assert len(writes) == 1 and "last_heartbeat" in writes[0], statements


def test_placing_a_replica_moves_the_generation_and_the_renewal_answers_in_full(
    node: tuple[Node, APIClient], fleet: Fleet
) -> None:
    n1, api = node
    fleet.add("m", min_replicas=1, max_replicas=1)
    reconcile_pass()
    assert Node.objects.get(pk=n1.pk).generation == 1
    answer = renew(api, 0)
    assert answer["changed"] is True and answer["generation"] == 1
    (replica,) = Replica.objects.filter(node=n1)
    assert [r["id"] for r in answer["replicas"]] == [str(replica.pk)]
    # The same orders a whole report gets.
    full = api.post("/api/v1/node/heartbeat", REPORT, format="json").json()
    assert full["replicas"] == answer["replicas"] and full["generation"] == 1
    assert renew(api, 1)["changed"] is False


def test_a_withdrawn_replica_is_answered_in_full_while_it_drains(
    node: tuple[Node, APIClient], fleet: Fleet
) -> None:
    n1, api = node
    fleet.add("m", min_replicas=1, max_replicas=1)
    reconcile_pass()
    (replica,) = Replica.objects.filter(node=n1)
    ready = [{"id": str(replica.pk), "state": "ready", "port": 41000}]
    api.post("/api/v1/node/heartbeat", {**REPORT, "replicas": ready}, format="json")
    generation = Node.objects.get(pk=n1.pk).generation
    model_remove(actor=fleet.owner, name="m")
    reconcile_pass()
    replica.refresh_from_db()
    assert replica.withdrawn_at is not None
    answer = renew(api, generation)
    # Still run while it drains, and no generation to name: its drain ends without a write.
    assert answer["changed"] is True and answer["generation"] is None
    assert [r["id"] for r in answer["replicas"]] == [str(replica.pk)]
    Replica.objects.filter(pk=replica.pk).update(
        withdrawn_at=timezone.now() - timedelta(seconds=services.DRAIN_SECONDS + 1)
    )
    answer = renew(api, None)
    assert answer["replicas"] == [] and answer["generation"] is not None


@pytest.mark.parametrize(
    "why",
    ["another digest", "lost", "silent past node_lost_after", "no digest (an older agent)"],
)
def test_a_renewal_the_control_plane_cannot_take_asks_for_the_whole_report(
    node: tuple[Node, APIClient], why: str
) -> None:
    n1, api = node
    digest = DIGEST
    if why == "another digest":
        digest = OTHER
    elif why == "lost":
        Node.objects.filter(pk=n1.pk).update(lost=True)
    elif why == "silent past node_lost_after":
        Node.objects.filter(pk=n1.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    else:
        Node.objects.filter(pk=n1.pk).update(report_digest="")
    before = Node.objects.get(pk=n1.pk)
    answer = renew(api, 0, digest)
    assert answer["report"] == "send" and answer["changed"] is False
    assert "replicas" not in answer
    after = Node.objects.get(pk=n1.pk)
    assert (after.last_heartbeat, after.lost) == (before.last_heartbeat, before.lost)


def test_a_removed_node_or_a_user_token_cannot_renew(
    node: tuple[Node, APIClient], tokens: dict[str, str]
) -> None:
    n1, api = node
    assert client(tokens["alice"]).post(
        "/api/v1/node/renew", {"report_digest": DIGEST}, format="json"
    ).status_code in (401, 403)
    n1.delete()
    assert (
        api.post("/api/v1/node/renew", {"report_digest": DIGEST}, format="json").status_code == 401
    )


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"report_digest": "not hex"},
        {"report_digest": DIGEST, "generation": -1},
        {"report_digest": DIGEST, "generation": "1"},
    ],
)
def test_a_bad_renewal_is_refused_with_a_reason_and_changes_nothing(
    node: tuple[Node, APIClient], body: dict[str, Any]
) -> None:
    n1, api = node
    before = Node.objects.get(pk=n1.pk).last_heartbeat
    response = api.post("/api/v1/node/renew", body, format="json")
    assert response.status_code == 400
    assert response.json()["detail"]
    assert Node.objects.get(pk=n1.pk).last_heartbeat == before


def test_a_bad_digest_in_a_report_is_refused(fleet: Fleet) -> None:
    fleet.node("n1")
    response = client(fleet.tokens["n1"]).post(
        "/api/v1/node/heartbeat", {**REPORT, "report_digest": "zz"}, format="json"
    )
    assert response.status_code == 400


def test_accepting_capacity_moves_the_generation_so_the_warning_goes(
    fleet: Fleet, users: dict[str, Any]
) -> None:
    fleet.node("n1", memory_gb=8)
    api = client(fleet.tokens["n1"])
    bigger = {**REPORT, "capacity": {"memory_gb": 16, "cores": 4}}
    answer = api.post("/api/v1/node/heartbeat", bigger, format="json").json()
    assert answer["warnings"]
    services.node_accept_capacity(actor=fleet.staff, name="n1")
    renewed = renew(api, answer["generation"])
    assert renewed["changed"] is True and renewed["warnings"] == []


def test_the_interval_grows_with_the_fleet_up_to_a_third_of_node_lost_after(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet.node("n1")
    fleet.node("n2")
    fleet.node("n3")
    monkeypatch.setattr(services, "NODES_PER_SECOND", 1)
    assert services.FleetSize().heartbeat_interval() == 3  # 3 nodes, one a second
    monkeypatch.setattr(services, "NODES_PER_SECOND", 500)
    assert services.FleetSize().heartbeat_interval() == 2  # never below 2 s
    counted = services.FleetSize(nodes=100_000, counted_at=time.monotonic())  # just now
    assert counted.heartbeat_interval() == 10  # node_lost_after 30 s: at most 10 s
    fleet.node("n4")
    assert counted.heartbeat_interval() == 10  # not counted again within FLEET_COUNT_SECONDS


def test_renewals_wait_in_memory_and_are_written_together(fleet: Fleet, settings: Any) -> None:
    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 3600  # the writer thread sleeps; flush() writes
    renewals = Liveness()
    a, b = fleet.node("a"), fleet.node("b")
    old = timezone.now() - timedelta(seconds=20)
    Node.objects.update(last_heartbeat=old)
    Node.objects.filter(pk=b.pk).update(lost=True)
    first = timezone.now()
    renewals.renewed(a.pk, first)
    renewals.renewed(a.pk, first + timedelta(seconds=1))  # the earliest is kept
    renewals.renewed(b.pk, first)
    assert Node.objects.get(pk=a.pk).last_heartbeat == old  # not yet written
    with CaptureQueriesContext(connection) as queries:
        assert renewals.flush() == 2
    statements = [q["sql"] for q in queries.captured_queries if "SAVEPOINT" not in q["sql"]]
    # One statement for the batch (on PostgreSQL it also says which rows no one else held).
    assert len(statements) == 1 and ("UPDATE" in statements[0]), statements
    assert Node.objects.get(pk=a.pk).last_heartbeat == first
    assert Node.objects.get(pk=b.pk).last_heartbeat == old  # lost: only a report brings it back
    # Never back in time: a whole report wrote a later time since.
    later = timezone.now() + timedelta(seconds=5)
    Node.objects.filter(pk=a.pk).update(last_heartbeat=later)
    renewals.renewed(a.pk, first)
    renewals.flush()
    assert Node.objects.get(pk=a.pk).last_heartbeat == later
    assert renewals.flush() == 0


@pytest.mark.django_db(transaction=True)
def test_a_renewal_of_a_node_whose_row_another_holds_is_written_once_it_is_free(
    fleet: Fleet, settings: Any
) -> None:
    """A reconcile pass placing thousands of replicas holds their nodes' rows until it commits;
    the renewals skipped meanwhile are written at the next flush, not dropped (dropped, a node
    held through several flushes went unrenewed until it was declared lost)."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no row locks: nothing is ever skipped")
    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 3600  # the writer thread sleeps; flush() writes
    renewals = Liveness()
    a, b = fleet.node("a"), fleet.node("b")
    old = timezone.now() - timedelta(seconds=20)
    Node.objects.update(last_heartbeat=old)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        from django.db import connection as theirs
        from django.db import transaction

        try:
            with transaction.atomic():
                Node.objects.select_for_update().get(pk=a.pk)
                held.set()
                release.wait(30)
        finally:
            theirs.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        now = timezone.now()
        renewals.renewed(a.pk, now)
        renewals.renewed(b.pk, now)
        assert renewals.flush() == 2
        assert Node.objects.get(pk=b.pk).last_heartbeat == now
        assert Node.objects.get(pk=a.pk).last_heartbeat == old  # held: skipped, not waited for
        assert renewals.pending == {a.pk: now}  # kept for the next flush
    finally:
        release.set()
        holder.join(10)
    assert renewals.flush() == 1
    assert Node.objects.get(pk=a.pk).last_heartbeat == now
    # One too old to matter is not kept: the node has renewed again since, or will.
    renewals.pending.clear()
    holder = threading.Thread(target=hold)
    held.clear()
    release.clear()
    holder.start()
    try:
        assert held.wait(10)
        renewals.renewed(a.pk, timezone.now() - timedelta(seconds=liveness.RETRY_SECONDS + 1))
        renewals.flush()
        assert renewals.pending == {}
    finally:
        release.set()
        holder.join(10)


def test_the_pending_renewals_are_bounded(fleet: Fleet, settings: Any) -> None:
    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 3600
    renewals = Liveness(max_pending=2)
    nodes = [fleet.node(f"n{i}") for i in range(3)]
    Node.objects.update(last_heartbeat=timezone.now() - timedelta(seconds=20))
    now = timezone.now()
    renewals.renewed(nodes[0].pk, now)
    assert len(renewals.pending) == 1
    renewals.renewed(nodes[1].pk, now)  # the bound: written at once
    assert len(renewals.pending) == 0
    assert Node.objects.filter(last_heartbeat=now).count() == 2
    assert isinstance(renewals.flusher, threading.Thread)


def test_ten_times_the_bound_of_renewals_never_holds_more_than_it(
    fleet: Fleet, settings: Any
) -> None:
    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 3600
    renewals = Liveness(max_pending=2)
    nodes = [fleet.node(f"n{i}") for i in range(20)]
    Node.objects.update(last_heartbeat=timezone.now() - timedelta(seconds=20))
    now = timezone.now()
    held = []
    for node in nodes:
        renewals.renewed(node.pk, now)
        held.append(len(renewals.pending))
    renewals.flush()
    assert max(held) < 2  # written each time the bound is reached
    assert Node.objects.filter(last_heartbeat=now).count() == 20  # none lost
