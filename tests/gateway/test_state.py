"""What tells the gateway's processes that routing changed: the database's own triggers."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from access.models import GatewayKey, RoutingVersion
from catalog.models import Model
from fleet.models import Node, Replica
from gateway import state as gateway_state
from gateway.state import GatewayState

pytestmark = pytest.mark.smoke


def version() -> int:
    return RoutingVersion.objects.get(pk=1).version


@pytest.mark.skipif(
    connection.vendor != "sqlite", reason="PostgreSQL notifies instead of bumping the version"
)
def test_changes_routing_sees_move_the_version_and_heartbeats_do_not(
    catalog: Any, keys: dict[str, str], engine: Any
) -> None:
    catalog.add("chat")
    replica = catalog.replica("chat", engine)
    start = version()

    # What heartbeats and idle clocks write all the time: nothing for routing.
    Replica.objects.filter(pk=replica.pk).update(
        message="all good", state_changed_at=timezone.now()
    )
    Node.objects.filter(pk=catalog.node.pk).update(last_heartbeat=timezone.now())
    Model.objects.filter(name="chat").update(demand_at=timezone.now())
    GatewayKey.objects.update(last_used_at=timezone.now())
    assert version() == start

    # What routing reads: each moves it (a key's change by more than one: the database stamps
    # the key's changed_at after, which counts as a change too).
    seen = version()

    def moved() -> bool:
        nonlocal seen
        before, seen = seen, version()
        return seen > before

    Replica.objects.filter(pk=replica.pk).update(withdrawn_at=timezone.now())
    assert moved()
    first_key = GatewayKey.objects.order_by("id")[0]
    GatewayKey.objects.filter(pk=first_key.pk).update(revoked_at=timezone.now())
    assert moved()
    Model.objects.filter(name="chat").update(fallbacks=["other"])
    assert moved()
    catalog.replica("chat", engine)
    assert moved()
    Node.objects.filter(pk=catalog.node.pk).update(cordoned=True)
    assert moved()
    # A user's is_active decides what their keys open: it moves it through their keys.
    owner = first_key.owner
    owner.is_active = False
    owner.save()
    assert moved()
    # Nothing else of a user matters to routing.
    owner.last_login = timezone.now()
    owner.save()
    assert not moved()


def test_the_snapshot_holds_what_a_request_needs(
    catalog: Any, keys: dict[str, str], engine: Any
) -> None:
    from access.models import hash_key
    from gateway.state import read_snapshot

    catalog.add("chat")
    catalog.add("lazy", min_replicas=0, max_replicas=1)
    catalog.add(
        "huge",
        min_replicas=0,
        max_replicas=1,
        profiles=[{"name": "cpu", "memory_gb": 99, "cores": 1}],
    )
    replica = catalog.replica("chat", engine)
    snapshot = read_snapshot()
    assert [c.id for c in snapshot.replicas["chat"]] == [str(replica.pk)]
    assert snapshot.keys[hash_key(keys["alice"])].active
    assert set(snapshot.unplaceable) == {"huge"}
    assert "its profiles need cpu: 99 GB, 1 cores" in snapshot.unplaceable["huge"]


def test_an_on_demand_gpu_model_wakes_only_where_a_gpu_engine_and_its_devices_are(
    catalog: Any,
) -> None:
    """The gateway's "fits on no node" asks the planner's rule with the node's GPU engine and
    devices: the reconciler would leave such a model unplaced, so it must not be woken."""
    from fleet.models import Node
    from gateway.state import read_snapshot

    gpu = {"name": "gpu", "memory_gb": 1, "cores": 1, "gpus": 1, "gpu_memory_gb": 20}
    catalog.add("vision", min_replicas=0, max_replicas=1, profiles=[gpu])
    device = {"index": 0, "uuid": "GPU-1", "name": "L4", "memory_used_mb": 0}
    node = Node.objects.get()
    node.gpus, node.gpu_memory_gb = 1, 24
    node.devices = [{**device, "memory_total_mb": 24 * 1024}]
    node.engine_backends = ["CPU"]
    node.save()
    why = read_snapshot().unplaceable["vision"]
    assert "no node's engine has a GPU backend" in why and "LLMGW_ENGINE=cuda" in why
    node.engine_backends = ["CPU", "CUDA"]
    node.save()
    assert "vision" not in read_snapshot().unplaceable
    # Its one GPU is too small for the profile's 20 GB.
    node.gpu_memory_gb = 16
    node.save()
    assert "vision" in read_snapshot().unplaceable


def test_keys_with_limits_are_held_apart_and_follow_each_change(
    keys: dict[str, str], users: dict[str, Any]
) -> None:
    from datetime import UTC, datetime

    from access.models import Team, hash_key
    from gateway.state import Keys, read_teams

    alice, bob = hash_key(keys["alice"]), hash_key(keys["bob"])
    team = Team.objects.create(name="ml", rpm=100, models=["chat-*"])
    GatewayKey.objects.filter(key_hash=alice).update(
        rpm=5, team=team, expires_at=datetime(2030, 1, 1, tzinfo=UTC), models=["chat"]
    )
    held = Keys.read()
    assert held[bob].limits is None  # no limits: nothing more is held for it
    limited = held[alice]
    assert limited.limits is not None and limited.limits.rpm == 5
    assert (limited.team_id, limited.expires_at) == (
        team.pk,
        datetime(2030, 1, 1, tzinfo=UTC).timestamp(),
    )
    assert limited.limits.allows("chat") and not limited.limits.allows("chat-a")
    assert held.limited == 1
    teams = read_teams()
    assert teams[team.pk].rpm == 100 and teams[team.pk].name == "ml"
    assert teams[team.pk].allows("chat-a")

    # Lifted: the key leaves the sparse table at the next refresh; a weight alone keeps it there.
    GatewayKey.objects.filter(key_hash=alice).update(
        rpm=None, team=None, expires_at=None, models=[], weight=2
    )
    held.refresh()
    weighted = held[alice].limits
    assert weighted is not None and weighted.weight == 2
    GatewayKey.objects.filter(key_hash=alice).update(weight=1)
    held.refresh()
    assert held[alice].limits is None and held.limited == 0

    # A deleted key (its owner deleted) leaves both tables.
    GatewayKey.objects.filter(key_hash=bob).update(tpm=10)
    held.refresh()
    assert held.limited == 1
    users["bob"].delete()
    held.refresh()
    assert bob not in held and held.limited == 0


def test_a_key_committed_during_a_look_waits_for_the_next_look(monkeypatch: Any) -> None:
    """A look counts from when it began reading: a request for a key committed while the
    refresher was reading (perhaps too late for that read) waits for the next look, which holds
    it, rather than being refused as soon as the look that missed it ends."""
    entered: queue.Queue[None] = queue.Queue()
    go: queue.Queue[None] = queue.Queue()

    class Poll(gateway_state._Watcher):
        def changed(self, timeout: float, wake: threading.Event) -> gateway_state.Changes:
            self.seen_from = time.monotonic()  # the version read: nothing new
            entered.put(None)
            go.get(timeout=10)
            return gateway_state.Changes()

    monkeypatch.setattr(gateway_state, "_watcher", Poll)
    refresher = GatewayState()
    monkeypatch.setattr(refresher, "reload", lambda: None)
    monkeypatch.setattr(refresher, "flush", lambda: None)
    refresher.start()
    try:
        entered.get(timeout=10)
        arrived = time.monotonic()  # the key committed, its request here: after the read
        go.put(None)
        entered.get(timeout=10)  # that look is over; the next one is reading
        assert not refresher.looked_since(arrived)
        go.put(None)
        entered.get(timeout=10)
        assert refresher.looked_since(arrived)
    finally:
        refresher._stop.set()
        for _ in range(3):
            go.put(None)
        refresher.stop()


def test_what_a_process_holds_per_key_to_write_stays_within_its_bounds(monkeypatch: Any) -> None:
    """Ten times the bound of keys, each used once. While the database is away the uses
    waiting to be written stop at MAX_PENDING_USES; once it answers, the last uses written
    lately stop at MAX_WRITTEN_USES (the older half forgotten each time it is passed). The
    memory held stays flat both ways, and llmgw_gateway_key_uses_entries says how many are
    held. The bounds are a hundredth of the gateway's here, which keeps the test to a second:
    each is one comparison with it, whatever its value."""
    import tracemalloc

    from django.db import OperationalError

    from access import services
    from gateway import metrics

    bound = 1000
    monkeypatch.setattr(gateway_state, "MAX_PENDING_USES", bound)
    monkeypatch.setattr(gateway_state, "MAX_WRITTEN_USES", bound)
    refresher = GatewayState()
    monkeypatch.setattr(refresher.book, "due", lambda: False)
    database = {"up": False}
    written: list[int] = []  # the first write's keys
    writes = {"keys": 0}

    def keys_used(key_ids: list[int]) -> None:
        if not database["up"]:
            raise OperationalError("the database is away")
        if not writes["keys"]:
            written.extend(key_ids)
        writes["keys"] += len(key_ids)

    monkeypatch.setattr(services, "keys_used", keys_used)
    board = metrics.metrics()
    first = 1_000_000  # key ids past the small ints Python shares: each one an object of its own
    most = {"held": 0}  # the most memory held after a flush

    def use(start: int, stop: int) -> None:
        for batch in range(start, stop, 100):
            for key_id in range(batch, batch + 100):
                refresher.key_used(first + key_id)
            try:
                refresher.flush()
            except OperationalError:
                assert not database["up"]
            most["held"] = max(most["held"], tracemalloc.get_traced_memory()[0])
            assert sum(refresher.sizes()) <= bound

    tracemalloc.start()
    try:
        # The database away: uses pile up to the bound, then no further.
        use(0, bound)
        at_bound, most["held"] = most["held"], 0
        use(bound, 10 * bound)
        assert len(refresher._used) == bound
        assert 50 * bound < at_bound  # what is measured holds the key ids
        assert most["held"] < at_bound * 1.1, (at_bound, most["held"])
        # Back: what was kept is written once, then each new key's use; the last uses written
        # lately stay within their bound, the oldest forgotten.
        database["up"] = True
        refresher.flush()
        assert sorted(written) == [first + key_id for key_id in range(bound)]
        assert len(refresher._used_written) == bound and not refresher._used
        # Measured once the bound has been passed twice (a dict's table, built again, is not
        # always as large as the first one was at the same size).
        use(10 * bound, 12 * bound)
        at_bound, most["held"] = most["held"], 0
        use(12 * bound, 20 * bound)
        assert 50 * bound < at_bound  # what is measured holds the key ids
        assert most["held"] < at_bound * 1.1, (at_bound, most["held"])
    finally:
        tracemalloc.stop()
    assert writes["keys"] == 11 * bound  # every use that was kept, written once
    assert first + 20 * bound - 1 in refresher._used_written  # the newest kept
    assert first + 10 * bound not in refresher._used_written  # the oldest forgotten
    shown = board.registry.get_sample_value("llmgw_gateway_key_uses_entries")
    assert shown == sum(refresher.sizes()) == len(refresher._used_written)


def test_the_snapshot_holds_what_the_database_holds_not_what_it_held(catalog: Any) -> None:
    """Its bound is the database's rows. Replicas come and go with every rollout: ten rounds of
    them, each round's withdrawn when the next comes, leave a snapshot of one round's, counted
    in llmgw_gateway_snapshot_entries, and no earlier snapshot held anywhere."""
    import gc
    import weakref

    from gateway import metrics

    catalog.add("chat")
    refresher = GatewayState()
    board = metrics.metrics()
    per_round = 20
    earlier: list[weakref.ref[Any]] = []
    for round_ in range(10):
        Replica.objects.filter(withdrawn_at__isnull=True).update(withdrawn_at=timezone.now())
        for index in range(per_round):
            catalog.replica("chat", 20_000 + round_ * per_round + index)
        snapshot = refresher.reload()
        assert len(snapshot.replicas["chat"]) == per_round
        assert snapshot.size() == 1 + per_round  # the catalog's one name and its replicas
        assert board.registry.get_sample_value("llmgw_gateway_snapshot_entries") == 1 + per_round
        earlier.append(weakref.ref(snapshot))
        del snapshot
    gc.collect()
    assert [ref() is None for ref in earlier] == [True] * 9 + [False]
