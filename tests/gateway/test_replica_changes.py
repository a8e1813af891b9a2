"""A replica's change reaches a running gateway process by name (PostgreSQL): the process reads
again the replicas named, not every replica, and still holds exactly what the database holds.

A fleet of thousands of nodes runs tens of thousands of replicas, and placing one model changes
hundreds of them a second; reading them all again at each change kept both gateway processes
busy for the whole placement (measured by bench/fleet.py at 5,000 nodes)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from access import triggers
from catalog.models import Model
from core.bulkinsert import insert_many
from fleet.models import Replica
from gateway import state as gateway_state
from gateway.routing import read_replicas
from gateway.state import MAX_NAMED, Changes, GatewayState, Snapshot, refresh_replicas
from tests.gateway.conftest import Catalog, GatewayServer
from tests.support.gateway_state import current_state
from tests.support.waiting import wait_for

# How soon a change reaches the running process: what these tests allow it.
WITHIN = 2.0


def settled() -> Snapshot:
    """The process's state once it has read every change committed until now: the model a
    test adds may be read whole more than once (a CI run caught a second whole read 21 ms after
    the one that first showed it), and a test that counts on no whole read after its own change
    must begin after them. A look that began after a commit has taken its notification
    (gateway.state.GatewayState.looked_since)."""
    now = time.monotonic()
    wait_for(
        lambda: current_state().looked_since(now),
        timeout=10,
        what="the gateway's refresher to take every change committed so far",
    )
    return current_state().get()


def held() -> dict[str, set[tuple[str, str, int]]]:
    return {
        model: {(c.id, c.state, c.port) for c in candidates}
        for model, candidates in current_state().get().replicas.items()
    }


def in_database() -> dict[str, set[tuple[str, str, int]]]:
    return {
        model: {(c.id, c.state, c.port) for c in candidates}
        for model, candidates in read_replicas().items()
    }


@pytest.fixture
def front(transactional_db: Any, monkeypatch: Any) -> Iterator[GatewayServer]:
    if connection.vendor != "postgresql":
        pytest.skip("replicas are named in notifications on PostgreSQL only")
    # No whole read but the first: only the notifications bring changes.
    monkeypatch.setattr(gateway_state, "FULL_SECONDS", 3600.0)
    monkeypatch.setattr(gateway_state, "SAFETY_SECONDS", 3600.0)
    running = GatewayServer(lifespan=True)
    yield running
    running.stop()


def test_changes_name_replicas_until_the_bound_then_say_everything() -> None:
    changes = Changes()
    assert not changes
    changes.take(f"{triggers.REPLICA_PREFIX}a")
    changes.take(f"{triggers.REPLICA_PREFIX}a")
    assert changes and not changes.everything and changes.replicas == {"a"}
    for n in range(MAX_NAMED):
        changes.take(f"{triggers.REPLICA_PREFIX}{n}")
    assert changes.everything and changes.replicas == set()  # the names are not kept past it
    other = Changes()
    other.take(f"{triggers.REPLICA_PREFIX}a")
    other.take("")  # a model, a node, a key: read everything
    assert other.everything and other.replicas == set()


def three_replicas(catalog: Catalog) -> tuple[Replica, Replica, Replica]:
    """Models chat (replicas on ports 8001 and 8002) and other (8003)."""
    catalog.add("chat", min_replicas=0, max_replicas=4)
    catalog.add("other", min_replicas=0, max_replicas=4)
    return (
        catalog.replica("chat", 8001),
        catalog.replica("chat", 8002),
        catalog.replica("other", 8003),
    )


def test_a_replica_changed_is_read_again_by_name_and_the_rest_kept(
    db: Any, catalog: Catalog
) -> None:
    one, two, three = three_replicas(catalog)
    refresher = GatewayState()
    before = refresher.reload()
    Replica.objects.filter(pk=one.pk).update(port=9001)
    Replica.objects.filter(pk=two.pk).update(withdrawn_at=timezone.now())
    four = catalog.replica("other", 8004)
    with CaptureQueriesContext(connection) as queries:
        after = refresher.refresh(Changes(replicas={str(one.pk), str(two.pk), str(four.pk)}))
    assert len(queries.captured_queries) == 1
    assert one.pk.hex in queries.captured_queries[0]["sql"].replace("-", "")
    assert {(c.id, c.port) for c in after.replicas["chat"]} == {(str(one.pk), 9001)}
    assert {c.id for c in after.replicas["other"]} == {str(three.pk), str(four.pk)}
    # The rest is the previous snapshot's, not read again; that one is unchanged.
    assert after.catalog is before.catalog and after.full_at == before.full_at
    assert {c.port for c in before.replicas["chat"]} == {8001, 8002}
    # A model whose last replica went is gone from the map, as a whole read leaves it out.
    Replica.objects.filter(pk=one.pk).delete()
    gone = refresh_replicas(after, {str(one.pk)})
    assert "chat" not in gone.replicas


def test_the_periodic_look_reads_again_only_the_replicas_whose_rows_changed(
    transactional_db: Any, catalog: Catalog
) -> None:
    """Every FULL_SECONDS a process looks for what a lost notification would have missed. It
    reads every replica's row version (and node's address), not every replica: reading 20,000
    whole held its GIL for half a second a minute, and its event loop's answers waited."""
    from fleet.models import Node
    from gateway.metrics import metrics

    one, two, three = three_replicas(catalog)
    refresher = GatewayState()
    before = refresher.reload()
    if connection.vendor != "postgresql":
        assert gateway_state.checked_replicas(before) is None  # SQLite: read whole
        return
    assert gateway_state.checked_replicas(before) is before.replicas  # nothing changed
    # Changes no notification told this process of (a lost one, or not yet taken).
    Replica.objects.filter(pk=one.pk).update(port=9001)
    Replica.objects.filter(pk=two.pk).update(withdrawn_at=timezone.now())
    four = catalog.replica("other", 8004)
    reread = metrics().replicas_reread._value.get()
    with CaptureQueriesContext(connection) as queries:
        after = refresher.check()
    by_id = [q["sql"] for q in queries.captured_queries if '"fleet_replica"."id" IN' in q["sql"]]
    assert len(by_id) == 1
    named = by_id[0].replace("-", "")
    assert all(r.pk.hex in named for r in (one, two, four)) and three.pk.hex not in named
    assert metrics().replicas_reread._value.get() == reread + 3
    assert {m: {(c.id, c.port) for c in cs} for m, cs in after.replicas.items()} == {
        "chat": {(str(one.pk), 9001)},
        "other": {(str(three.pk), 8003), (str(four.pk), 8004)},
    }
    assert after.full_at > before.full_at
    # The node's address is compared too: it is read through the replica, not its row.
    Node.objects.filter(pk=three.node_id).update(address="10.1.2.3")
    moved = refresher.check()
    assert {c.address for cs in moved.replicas.values() for c in cs} == {"10.1.2.3"}


def test_a_running_gateway_holds_what_the_database_holds_through_inserts_updates_and_deletes(
    front: GatewayServer, catalog: Catalog
) -> None:
    catalog.add("chat", min_replicas=0, max_replicas=50)
    wait_for(
        lambda: current_state().get().catalog.entries.get("chat") is not None,
        timeout=WITHIN,
        what="chat in the catalog",
    )
    first = settled()
    made = [catalog.replica("chat", 8000 + n, state=Replica.STARTING) for n in range(20)]
    wait_for(
        lambda: len(held().get("chat", ())) == 20, timeout=WITHIN, what="the 20 new replicas held"
    )
    Replica.objects.filter(pk__in=[r.pk for r in made[:10]]).update(state=Replica.READY)
    Replica.objects.filter(pk=made[10].pk).update(state=Replica.FAILED)
    Replica.objects.filter(pk=made[11].pk).delete()
    Replica.objects.filter(pk=made[12].pk).update(withdrawn_at=timezone.now())
    wait_for(
        lambda: held() == in_database(),
        timeout=WITHIN,
        what="the replicas held as the database holds them",
    )
    ready = {c.id for c in current_state().get().replicas["chat"] if c.state == Replica.READY}
    assert ready == {str(r.pk) for r in made[:10]} and len(held()["chat"]) == 17
    # All of it by name: the catalog was never read again after the first read.
    assert current_state().get().full_at == first.full_at
    # A model's change is read whole: its replicas go with it.
    Model.objects.filter(name="chat").delete()
    wait_for(
        lambda: "chat" not in held(), timeout=WITHIN, what="chat's replicas gone with the model"
    )
    assert current_state().get().full_at > first.full_at


def test_replicas_the_reconciler_inserts_with_copy_reach_a_running_gateway_by_name(
    front: GatewayServer, catalog: Catalog
) -> None:
    """The reconciler inserts new replicas with COPY (core.bulkinsert), which fires the row
    triggers INSERT fires: each is named to the gateway."""
    catalog.add("chat", min_replicas=0, max_replicas=50)
    wait_for(
        lambda: current_state().get().catalog.entries.get("chat") is not None,
        timeout=WITHIN,
        what="chat in the catalog",
    )
    first = settled()
    model = Model.objects.get(name="chat")
    rows = [
        Replica(
            model=model,
            model_name="chat",
            node=catalog.node,
            profile="cpu",
            spec={"adapters": []},
            spec_key="k",
            state=Replica.READY,
            port=8100 + n,
        )
        for n in range(30)
    ]
    insert_many(Replica, rows)
    wait_for(
        lambda: len(held().get("chat", ())) == 30,
        timeout=WITHIN,
        what="the 30 copied replicas held",
    )
    assert held() == in_database()
    assert current_state().get().full_at == first.full_at
