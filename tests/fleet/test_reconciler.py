"""Reconcile passes against the database, with heartbeats standing in for the agents."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from catalog.models import AuditEntry, Model
from catalog.services import (
    model_demand,
    model_remove,
    model_restart,
    model_scale,
    model_set_resources,
)
from fleet.footprint import learn_facts
from fleet.models import Lease, Node, Replica, hash_token
from fleet.reconciler import (
    MAX_START_FAILURES,
    claim_lease,
    fleet_members,
    forget_quiet,
    planner_node,
    reconcile_pass,
)
from fleet.services import node_cordon

pytestmark = pytest.mark.django_db


def settle(fleet: Any, passes: int = 8) -> None:
    """Passes and heartbeats (every replica reports ready) until nothing changes."""
    for _ in range(passes):
        report = reconcile_pass()
        for node in {r.node.name for r in Replica.objects.select_related("node")}:
            fleet.beat(node)
        if not report.started and not report.withdrawn:
            return


def test_a_model_gets_its_min_replicas_spread_over_nodes(fleet: Any) -> None:
    fleet.node("a")
    fleet.node("b")
    fleet.add("chat", min_replicas=2)
    report = reconcile_pass()
    assert len(report.started) == 2
    assert sorted(r.node.name for r in fleet.replicas("chat")) == ["a", "b"]
    assert reconcile_pass().started == []  # idempotent


def test_the_node_is_told_what_to_run_and_reports_it_ready(fleet: Any) -> None:
    fleet.node("a")
    fleet.add("chat")
    reconcile_pass()
    answer = fleet.beat("a", states={})
    [order] = answer["replicas"]
    assert (
        order["model"] == "chat" and order["threads"] == 1 and order["source"].endswith("chat.gguf")
    )
    fleet.beat("a", states={order["id"]: "ready"})
    assert Replica.objects.get().routable


def test_scaling_up_and_down(fleet: Any) -> None:
    fleet.node("a", memory_gb=16)
    model = fleet.add("chat", min_replicas=1)
    settle(fleet)
    model_scale(actor=fleet.owner, name="chat", min_replicas=3)
    settle(fleet)
    assert len(fleet.replicas("chat")) == 3
    model_scale(actor=fleet.owner, name="chat", min_replicas=1)
    report = reconcile_pass()
    assert len(report.withdrawn) == 2
    assert len(fleet.replicas("chat")) == 1
    assert model.pk


def test_parked_and_removed_models_run_nothing(fleet: Any) -> None:
    fleet.node("a")
    fleet.add("chat", min_replicas=1)
    settle(fleet)
    model_scale(actor=fleet.owner, name="chat", min_replicas=0, max_replicas=0)
    reconcile_pass()
    assert fleet.replicas("chat") == []
    fleet.add("other")
    settle(fleet)
    model_remove(actor=fleet.owner, name="other")
    reconcile_pass()
    assert fleet.replicas("other") == []
    assert Replica.objects.filter(withdraw_reason="model removed from the catalog").count() == 1


def test_withdrawn_replicas_drain_then_leave_the_node(fleet: Any) -> None:
    fleet.node("a")
    fleet.add("chat")
    settle(fleet)
    model_scale(actor=fleet.owner, name="chat", min_replicas=0, max_replicas=0)
    reconcile_pass()
    replica = Replica.objects.get()
    assert not replica.routable
    assert [r["id"] for r in fleet.beat("a")["replicas"]] == [str(replica.pk)]  # still draining
    Replica.objects.update(withdrawn_at=timezone.now() - timedelta(seconds=30))
    assert fleet.beat("a")["replicas"] == []
    # The node stopped it and no longer reports it: the row goes.
    from fleet.models import Node
    from fleet.services import node_heartbeat

    node_heartbeat(
        node=Node.objects.get(name="a"),
        report={
            "capacity": {"memory_gb": 8, "cores": 4, "gpus": 0, "gpu_memory_gb": 0},
            "replicas": [],
        },
        interval=2,
    )
    assert not Replica.objects.exists()


def test_a_withdrawal_stamped_before_the_clock_stepped_back_does_not_drain_for_the_step(
    fleet: Any,
) -> None:
    fleet.node("a")
    fleet.add("chat")
    settle(fleet)
    model_scale(actor=fleet.owner, name="chat", min_replicas=0, max_replicas=0)
    reconcile_pass()
    replica = Replica.objects.get()
    assert [r["id"] for r in fleet.beat("a")["replicas"]] == [str(replica.pk)]  # draining
    # Stamped by a clock five minutes ahead of the web's now (it stepped back since).
    Replica.objects.update(withdrawn_at=timezone.now() + timedelta(minutes=5))
    assert fleet.beat("a")["replicas"] == []


def test_on_demand_loads_one_replica_when_asked_and_stops_when_idle(fleet: Any) -> None:
    fleet.node("a")
    fleet.add("lazy", min_replicas=0, max_replicas=3, idle_timeout="1m")
    reconcile_pass()
    assert fleet.replicas("lazy") == []
    model_demand(name="lazy")
    reconcile_pass()
    assert len(fleet.replicas("lazy")) == 1  # one, however high max is
    Model.objects.filter(name="lazy").update(demand_at=timezone.now() - timedelta(minutes=2))
    reconcile_pass()
    assert fleet.replicas("lazy") == []


def test_a_restart_replaces_replicas_one_at_a_time_with_one_always_ready(fleet: Any) -> None:
    fleet.node("a", memory_gb=8)
    fleet.node("b", memory_gb=8)
    fleet.add("chat", min_replicas=2)
    settle(fleet)
    old = {r.pk for r in fleet.replicas("chat")}
    model_restart(actor=fleet.owner, name="chat")
    for _ in range(20):
        reconcile_pass()
        ready = [r for r in fleet.replicas("chat") if r.routable]
        assert len(ready) >= 2 - 0, "a replica must stay ready at every moment"  # surge keeps both
        fleet.beat("a")
        fleet.beat("b")
        if not old & {r.pk for r in fleet.replicas("chat")} and len(fleet.replicas("chat")) == 2:
            break
    current = fleet.replicas("chat")
    assert len(current) == 2 and not old & {r.pk for r in current}
    assert all(r.spec["generation"] == 1 for r in current)


def test_without_room_for_an_extra_replica_it_replaces_in_place(fleet: Any) -> None:
    fleet.node("a", memory_gb=1, cores=1)
    fleet.add("chat", min_replicas=1)
    settle(fleet)
    [old] = fleet.replicas("chat")
    model_restart(actor=fleet.owner, name="chat")
    report = reconcile_pass()
    assert str(old.pk) in report.withdrawn
    assert (
        Replica.objects.get(pk=old.pk).withdraw_reason
        == "replaced in place: no room for an extra replica"
    )
    settle(fleet)
    [new] = fleet.replicas("chat")
    assert new.spec["generation"] == 1


def test_changed_resources_make_replicas_out_of_date(fleet: Any) -> None:
    fleet.node("a", memory_gb=16)
    fleet.add("chat")
    settle(fleet)
    model_set_resources(actor=fleet.owner, name="chat", memory_gb=2)
    settle(fleet)
    [replica] = fleet.replicas("chat")
    assert replica.memory_gb == 2


def test_a_replica_failing_repeatedly_halts_the_replacement_and_old_ones_keep_serving(
    fleet: Any,
) -> None:
    fleet.node("a", memory_gb=16)
    fleet.add("chat")
    settle(fleet)
    [old] = fleet.replicas("chat")
    model_restart(actor=fleet.owner, name="chat")
    for _ in range(MAX_START_FAILURES):
        reconcile_pass()
        new = [r for r in fleet.replicas("chat") if r.pk != old.pk]
        assert len(new) == 1
        fleet.beat("a", states={str(old.pk): "ready", str(new[0].pk): "failed"})
        Replica.objects.filter(pk=new[0].pk).update(message="the engine exited with code 139")
    reconcile_pass()
    reconcile_pass()
    model = Model.objects.get(name="chat")
    assert model.rollout_halted.startswith(
        f"halted: a new replica failed to become ready {MAX_START_FAILURES} times"
    )
    assert "the engine exited with code 139" in model.rollout_halted
    assert [r.pk for r in fleet.replicas("chat")] == [old.pk]
    assert Replica.objects.get(pk=old.pk).routable
    assert AuditEntry.objects.filter(action="rollout-halted", model_name="chat").exists()
    # a new restart (or rollback) starts afresh
    model_restart(actor=fleet.owner, name="chat")
    reconcile_pass()
    assert Model.objects.get(name="chat").rollout_halted == ""
    assert len(fleet.replicas("chat")) == 2


def test_a_lost_node_has_its_replicas_placed_elsewhere(fleet: Any) -> None:
    fleet.node("a")
    fleet.node("b")
    fleet.add("chat", min_replicas=1)
    settle(fleet)
    [replica] = fleet.replicas("chat")
    from fleet.models import Node

    Node.objects.filter(name=replica.node.name).update(
        last_heartbeat=timezone.now() - timedelta(minutes=5)
    )
    # The other node has been heard all along.
    Node.objects.exclude(name=replica.node.name).update(
        heard_since=timezone.now() - timedelta(minutes=10)
    )
    report = reconcile_pass()
    assert report.nodes_lost == [replica.node.name]
    [moved] = fleet.replicas("chat")
    assert moved.node.name != replica.node.name
    assert "lost" in Replica.objects.get(pk=replica.pk).withdraw_reason


def test_no_node_is_lost_when_the_control_plane_heard_none(fleet: Any) -> None:
    """Every node silent (the web process or the database was down for minutes): none is lost
    and every replica stays in routing; once heartbeats come again, a node still silent is lost
    only after another has been heard for node_lost_after."""
    from fleet.models import Node

    fleet.node("a")
    fleet.node("b")
    fleet.add("chat", min_replicas=2)
    settle(fleet)
    Node.objects.update(
        last_heartbeat=timezone.now() - timedelta(minutes=5),
        heard_since=timezone.now() - timedelta(minutes=50),
    )
    report = reconcile_pass()
    assert report.nodes_lost == []
    assert len([r for r in fleet.replicas("chat") if r.routable]) == 2

    fleet.beat("a")  # the control plane is reachable again: a is heard first
    assert Node.objects.get(name="a").heard_since > timezone.now() - timedelta(seconds=5)
    assert reconcile_pass().nodes_lost == []
    # b stays silent while a has been heard for node_lost_after (30 s): b is lost.
    Node.objects.filter(name="a").update(heard_since=timezone.now() - timedelta(seconds=31))
    assert reconcile_pass().nodes_lost == ["b"]
    [still, _moved] = sorted(fleet.replicas("chat"), key=lambda r: r.node.name != "a")
    assert still.node.name == "a" and still.routable


def test_a_cordoned_node_gets_nothing_new(fleet: Any) -> None:
    from fleet.services import node_cordon

    fleet.node("a")
    fleet.node("b")
    node_cordon(actor=fleet.staff, name="a", cordoned=True)
    fleet.add("chat", min_replicas=2)
    reconcile_pass()
    assert [r.node.name for r in fleet.replicas("chat")] == ["b", "b"]


def test_a_lower_class_is_preempted_for_a_critical_model_and_it_is_audited(fleet: Any) -> None:
    fleet.node("a", memory_gb=2, cores=2)
    fleet.add(
        "filler",
        min_replicas=2,
        profiles=[{"name": "cpu", "memory_gb": 1, "cores": 1}],
        **{"class": "opportunistic"},
    )
    settle(fleet)
    fleet.add(
        "vip", profiles=[{"name": "cpu", "memory_gb": 1, "cores": 1}], **{"class": "critical"}
    )
    report = reconcile_pass()
    assert len(report.preempted) == 1
    assert len(fleet.replicas("vip")) == 1 and len(fleet.replicas("filler")) == 1
    entry = AuditEntry.objects.get(action="preempt")
    assert (entry.actor_name, entry.model_name) == ("system", "filler")
    assert "vip" in entry.note


def test_only_one_pass_runs_at_a_time() -> None:
    assert claim_lease("reconcile", "someone-else", 60)
    assert reconcile_pass().skipped
    Lease.objects.filter(name="reconcile").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert not reconcile_pass().skipped


def test_a_worker_clock_stepped_back_still_runs_passes(fleet: Any, monkeypatch: Any) -> None:
    fleet.node("a")
    fleet.add("chat", min_replicas=1)
    assert reconcile_pass(periodic=True).started  # its lease released, its start recorded
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(minutes=5))
    model_scale(actor=fleet.owner, name="chat", min_replicas=2)
    report = reconcile_pass(periodic=True)
    assert not report.skipped and len(report.started) == 1
    model_scale(actor=fleet.owner, name="chat", min_replicas=3)
    report = reconcile_pass(kicked_at=timezone.now() + timedelta(seconds=2))
    assert not report.skipped and len(report.started) == 1
    # And stepped forward, a running pass's lease stays its own.
    assert claim_lease("reconcile", "running", 120)
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(minutes=5))
    assert reconcile_pass(periodic=True).busy


def test_a_pass_uses_the_same_number_of_queries_for_more_models_and_nodes(
    fleet: Any, django_assert_max_num_queries: Any
) -> None:
    from django.test.utils import CaptureQueriesContext

    def steady_pass_queries() -> int:
        settle(fleet)
        # Steady: every model file's header has been asked for (here they do not answer).
        while learn_facts(Model.objects.all()):
            pass
        forget_quiet()  # a whole pass, not one that stops at "nothing changed"
        with CaptureQueriesContext(connection) as captured:
            reconcile_pass()
        return len(captured.captured_queries)

    fleet.node("n0", memory_gb=64, cores=64)
    fleet.add("m0")
    few = steady_pass_queries()
    for i in range(1, 6):
        fleet.node(f"n{i}", memory_gb=64, cores=64)
    for i in range(1, 20):
        fleet.add(f"m{i}")
    assert steady_pass_queries() == few


def quiet_fleet(fleet: Any) -> None:
    """Two nodes, a model of two replicas, every one ready; then a pass that finds nothing to
    do, which the next pass compares itself with."""
    fleet.node("a", memory_gb=16)
    fleet.node("b", memory_gb=16)
    fleet.add("chat", min_replicas=2)
    settle(fleet)
    while learn_facts(Model.objects.all()):
        pass
    report = reconcile_pass()
    assert not (report.started or report.withdrawn)


def replica_reads(queries: list[dict[str, Any]]) -> list[str]:
    """The queries that read replicas' rows (not the stamp's sum over them)."""
    return [
        q["sql"]
        for q in queries
        if 'FROM "fleet_replica"' in q["sql"] and q["sql"].lstrip().upper().startswith("SELECT")
    ]


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the stamp is PostgreSQL's")
def test_a_pass_after_a_quiet_one_with_nothing_changed_reads_no_replicas(fleet: Any) -> None:
    from django.test.utils import CaptureQueriesContext

    quiet_fleet(fleet)
    for beat in ("a", "b"):  # heartbeats move nothing a pass decides by
        fleet.beat(beat)
    with CaptureQueriesContext(connection) as captured:
        report = reconcile_pass()
    assert not report.skipped and not (report.started or report.withdrawn)
    assert replica_reads(captured.captured_queries) == []
    forget_quiet()
    with CaptureQueriesContext(connection) as captured:
        reconcile_pass()
    assert replica_reads(captured.captured_queries)  # the check above can fail


@pytest.mark.parametrize("change", ["scale", "cordon", "failed", "node"])
def test_a_change_after_a_quiet_pass_is_acted_on(fleet: Any, change: str) -> None:
    quiet_fleet(fleet)
    if change == "scale":
        model_scale(actor=fleet.owner, name="chat", min_replicas=3)
        assert len(reconcile_pass().started) == 1
    elif change == "cordon":
        # A cordoned node gets nothing new: the third replica goes to the other.
        node_cordon(actor=fleet.staff, name="a", cordoned=True)
        reconcile_pass()
        model_scale(actor=fleet.owner, name="chat", min_replicas=3)
        reconcile_pass()
        assert sorted(r.node.name for r in fleet.replicas("chat")) == ["a", "b", "b"]
    elif change == "failed":
        replica = fleet.replicas("chat")[0]
        fleet.beat(replica.node.name, states={str(replica.pk): "failed"})
        report = reconcile_pass()
        assert report.withdrawn == [str(replica.pk)] and len(report.started) == 1
    else:
        # A replica's node gone: its replicas are placed again on the node that is left.
        gone = fleet.replicas("chat")[0].node
        Node.objects.filter(pk=gone.pk).delete()
        assert len(reconcile_pass().started) == 1


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the stamp is PostgreSQL's")
def test_replicas_turning_ready_after_a_quiet_pass_are_not_read_again(fleet: Any) -> None:
    """Nothing failed and no model being replaced: their states decide nothing (a model of
    thousands placed, their reports of them ready would each have a pass read them all)."""
    from django.test.utils import CaptureQueriesContext

    fleet.node("a", memory_gb=16)
    fleet.node("b", memory_gb=16)
    fleet.add("chat", min_replicas=2)
    while learn_facts(Model.objects.all()):
        pass
    assert len(reconcile_pass().started) == 2
    report = reconcile_pass()  # nothing to do while they start: the pass the next compares with
    assert not (report.started or report.withdrawn)
    for node in ("a", "b"):
        fleet.beat(node)
    assert {r.state for r in fleet.replicas("chat")} == {Replica.READY}
    with CaptureQueriesContext(connection) as captured:
        report = reconcile_pass()
    assert not report.skipped and not (report.started or report.withdrawn)
    assert replica_reads(captured.captured_queries) == []


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the stamp is PostgreSQL's")
def test_a_header_that_could_not_be_read_keeps_a_quiet_pass_quiet(
    fleet: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header read since the last quiet pass that leaves every profile reserving what it did
    (here it could not be read: the profile's own figures stay in force, as before it was read)
    changes nothing a pass would do: the pass stops at the stamp. Models added at once have their
    headers read a few a pass, and each of those passes read and planned the whole fleet."""
    from django.test.utils import CaptureQueriesContext

    from fleet import reconciler
    from fleet.models import ModelFile

    quiet_fleet(fleet)
    ModelFile.objects.all().delete()  # as if the header was never asked for
    with monkeypatch.context() as patched:
        patched.setattr(reconciler, "learn_facts", lambda *args, **kwargs: 0)
        forget_quiet()
        reconcile_pass()  # a whole pass that changes nothing, the header not read
    with CaptureQueriesContext(connection) as captured:
        report = reconcile_pass()  # reads the header (the mirror does not answer here)
    assert ModelFile.objects.get().error
    assert not report.skipped and not (report.started or report.withdrawn)
    assert replica_reads(captured.captured_queries) == []


def test_a_new_replica_ready_after_a_quiet_pass_lets_the_old_one_go(fleet: Any) -> None:
    """While a model is replaced its replicas' states decide: the pass after the new replica is
    ready withdraws an old one, even though the pass before it changed nothing."""
    quiet_fleet(fleet)
    old = {str(r.pk) for r in fleet.replicas("chat")}
    model_restart(actor=fleet.owner, name="chat")
    started = reconcile_pass().started
    assert len(started) == 1  # one extra, of the new spec, before an old one goes
    report = reconcile_pass()  # it is not ready yet: nothing changes
    assert not (report.started or report.withdrawn)
    fleet.beat(Replica.objects.get(pk=started[0]).node.name)
    report = reconcile_pass()
    assert len(report.withdrawn) == 1 and set(report.withdrawn) <= old


def test_a_pass_sees_a_node_as_its_row_as_it_would_see_the_node(fleet: Any) -> None:
    """A pass reads nodes as rows (fleet_members): the planner sees each as it sees the node."""
    now = timezone.now()
    devices = [
        {"index": 1, "memory_total_mb": 24576, "memory_used_mb": 512},
        {"index": 0, "memory_total_mb": 16384, "memory_used_mb": 99999},
        {"index": "x", "memory_total_mb": 1, "memory_used_mb": 0},
    ]
    shapes: list[dict[str, Any]] = [
        {"last_heartbeat": now},
        {"last_heartbeat": now, "cordoned": True},
        {"last_heartbeat": now, "lost": True},
        {"last_heartbeat": None},
        {"last_heartbeat": now, "gpus": 2, "gpu_memory_gb": 24, "devices": devices},
        {"last_heartbeat": now, "gpus": 2, "gpu_memory_gb": 16, "engine_backends": ["CUDA"]},
    ]
    for i, shape in enumerate(shapes):
        Node.objects.create(
            name=f"n{i}", token_hash=hash_token(f"t{i}"), memory_gb=8 + i, cores=2 + i, **shape
        )
    members = {m.name: m for m in fleet_members()}
    assert sorted(members) == sorted(n.name for n in Node.objects.all())
    for node in Node.objects.all():
        assert planner_node(members[node.name]) == planner_node(node)
    schedulable = {name for name, m in members.items() if m.schedulable}
    assert schedulable == {"n0", "n4", "n5"}


def test_a_slow_heartbeat_does_not_start_a_nodes_run_of_heartbeats_again() -> None:
    """A gap shorter than node_lost_after (a heartbeat late on a busy machine) keeps heard_since;
    a silence longer than that (the control plane unreachable) starts it again."""
    since = timezone.now() - timedelta(minutes=5)
    last = timezone.now() - timedelta(seconds=4)
    node = Node(name="a", heard_since=since, last_heartbeat=last)
    assert node.heard_since_with(last + timedelta(seconds=5), lost_after=6) == since
    late = last + timedelta(seconds=7)
    assert node.heard_since_with(late, lost_after=6) == late


def _roll_until_replaced(fleet: Any, model: str, old: set[Any], nodes: list[str]) -> None:
    """Passes and heartbeats until none of `old` runs; a replica of the model is ready all along."""
    for _ in range(30):
        reconcile_pass()
        assert any(r.routable for r in fleet.replicas(model)), "the model had no ready replica"
        for name in nodes:
            fleet.beat(name)
        if not old & {r.pk for r in fleet.replicas(model)}:
            return
    raise AssertionError(f"{model} still runs {old & {r.pk for r in fleet.replicas(model)}}")


def test_a_restart_keeps_the_replicas_spread_over_nodes(fleet: Any) -> None:
    # Room for every replica on either node: a replacement is drawn to the fuller node by best
    # fit unless the replicas on their way out leave the spread to the new ones.
    fleet.node("a")
    fleet.node("b")
    fleet.add("chat", min_replicas=2)
    settle(fleet)
    assert sorted(r.node.name for r in fleet.replicas("chat")) == ["a", "b"]
    for _ in range(3):  # an update, a rollback, a restart: each a replacement of every replica
        model_restart(actor=fleet.owner, name="chat")
        _roll_until_replaced(fleet, "chat", {r.pk for r in fleet.replicas("chat")}, ["a", "b"])
        settle(fleet)
        assert sorted(r.node.name for r in fleet.replicas("chat")) == ["a", "b"]


def test_a_node_back_from_lost_gets_a_replica_moved_to_it(fleet: Any) -> None:
    fleet.node("a")
    fleet.node("b")
    fleet.add("chat", min_replicas=2)
    settle(fleet)
    Node.objects.filter(name="b").update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    Node.objects.filter(name="a").update(heard_since=timezone.now() - timedelta(minutes=10))
    assert reconcile_pass().nodes_lost == ["b"]
    for _ in range(3):
        fleet.beat("a")
        reconcile_pass()
    bunched = fleet.replicas("chat")
    assert [r.node.name for r in bunched] == ["a", "a"]

    fleet.beat("b")  # it is back
    report = reconcile_pass()
    assert len(report.moved) == 1 and report.started == [] and report.withdrawn == []
    moving = Replica.objects.get(pk=report.moved[0])
    assert moving.node.name == "a"
    assert moving.move_reason == (
        "moving to spread the model: node a holds 2 of its replicas "
        "and node b, which has room for one, holds none"
    )
    assert AuditEntry.objects.filter(action="move", model_name="chat").count() == 1
    # The API's answer (model target) says it too.
    from fleet.api import TargetOut
    from fleet.selectors import model_target

    shown = TargetOut(model_target(Model.objects.get(name="chat"))).data["replicas"]
    assert {r["id"]: r["move_reason"] for r in shown}[str(moving.pk)] == moving.move_reason
    # Its replacement first, on b; it leaves only once that one is ready.
    report = reconcile_pass()
    [new] = [Replica.objects.get(pk=pk) for pk in report.started]
    assert new.node.name == "b" and report.withdrawn == []
    fleet.beat("b", states={str(new.pk): "starting"})
    assert reconcile_pass().withdrawn == []
    fleet.beat("b")
    assert reconcile_pass().withdrawn == [str(moving.pk)]
    settle(fleet)
    assert sorted(r.node.name for r in fleet.replicas("chat")) == ["a", "b"]
    assert reconcile_pass().moved == []  # spread: nothing more to move


def test_a_move_whose_replacement_fits_nowhere_now_is_called_off(fleet: Any) -> None:
    fleet.node("a", memory_gb=2, cores=2)
    fleet.add("chat", min_replicas=2)
    settle(fleet)
    first, second = fleet.replicas("chat")
    Replica.objects.filter(pk=first.pk).update(move_reason="moving to spread the model")
    report = reconcile_pass()
    assert report.withdrawn == [] and report.started == []
    assert Replica.objects.get(pk=first.pk).move_reason == ""
    assert {r.pk for r in fleet.replicas("chat")} == {first.pk, second.pk}
    assert reconcile_pass().moved == []  # and one node is all there is: nothing to move to
