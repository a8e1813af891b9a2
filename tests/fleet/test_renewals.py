"""Which renewals the gateway answers itself (fleet.renewals.held_row) and its copy of the nodes
(NodeTable.read); the whole path through real processes is in tests/fleet/test_fleet_e2e.py."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from fleet import renewals
from fleet.models import Node
from fleet.renewals import NodeRow, NodeTable, Renewals, held_row
from gateway.process import RenewalDoor
from llmgw import bearer
from tests.support.fleet import Fleet
from tests.support.waiting import wait_for_async

TOKEN = "llmgw-node-abc"
DIGEST = "d" * 64
NOW = timezone.now()


def rows(**changes: Any) -> dict[str, NodeRow]:
    row = {
        "pk": 7,
        "name": "n1",
        "generation": 3,
        "lost": False,
        "report_digest": DIGEST,
        "last_heartbeat": NOW - timedelta(seconds=2),
        **changes,
    }
    heard = row.pop("last_heartbeat")
    row["heard"] = None if heard is None else heard.timestamp()
    return {bearer.digest(TOKEN): NodeRow(**row)}


def body(**changes: Any) -> bytes:
    return json.dumps({"generation": 3, "report_digest": DIGEST, **changes}).encode()


def held(table: NodeTable, monkeypatch: pytest.MonkeyPatch, taken: list[int]) -> Renewals:
    """A process's renewals holding `table`, its renewals recorded in `taken` (nothing written),
    with the gateway's door."""
    from gateway.metrics import metrics

    renewals = Renewals(RenewalDoor(metrics()), table=table)
    monkeypatch.setattr(renewals.liveness, "renewed", lambda pk, at: taken.append(pk))
    return renewals


def test_a_current_renewal_of_a_held_node_is_answered_here() -> None:
    row = held_row(rows(), f"Bearer {TOKEN}", body(), NOW, 30)
    assert row is not None and (row.pk, row.name, row.generation) == (7, "n1", 3)
    assert held_row(rows(), f"token {TOKEN}", body(), NOW, 30) is not None


@pytest.mark.parametrize(
    ("held", "authorization", "sent"),
    [
        (rows(), "Bearer another-token", body()),  # not held (or new): the web says 401 or knows
        (rows(), "", body()),
        (rows(), f"Basic {TOKEN}", body()),
        (rows(), f"Bearer {TOKEN}", body(generation=2)),  # an older generation: orders to send
        (rows(), f"Bearer {TOKEN}", body(generation=None)),
        (rows(), f"Bearer {TOKEN}", body(generation=True)),
        (rows(), f"Bearer {TOKEN}", body(report_digest="e" * 64)),  # another report
        (rows(), f"Bearer {TOKEN}", b"not json"),
        (rows(), f"Bearer {TOKEN}", b"[1, 2]"),
        (rows(), f"Bearer {TOKEN}", b"[" * 4096),  # deeper than the parser recurses
        (rows(lost=True), f"Bearer {TOKEN}", body()),
        (rows(report_digest=""), f"Bearer {TOKEN}", body(report_digest="")),
        (rows(last_heartbeat=None), f"Bearer {TOKEN}", body()),
        (rows(last_heartbeat=NOW - timedelta(seconds=31)), f"Bearer {TOKEN}", body()),
    ],
)
def test_anything_else_goes_to_the_web(held: Any, authorization: str, sent: bytes) -> None:
    assert held_row(held, authorization, sent, NOW, 30) is None


@pytest.mark.django_db
def test_the_copy_holds_each_node_by_its_tokens_digest(users: dict[str, Any]) -> None:
    Fleet(users["staff"], users["alice"]).node("n1")
    Node.objects.filter(name="n1").update(generation=5, report_digest=DIGEST)
    table = NodeTable()
    table.read()
    (row,) = table.rows.values()
    assert table.rows == {Node.objects.get().token_hash: row}
    assert (row.name, row.generation, row.report_digest, row.lost) == ("n1", 5, DIGEST, False)
    assert row.last_heartbeat is not None and row.last_heartbeat.tzinfo is not None
    assert abs(row.last_heartbeat - Node.objects.get().last_heartbeat) < timedelta(milliseconds=1)
    assert table.ready.is_set() and table.lost_after == 30


def scope(token: str, method: str = "POST") -> dict[str, Any]:
    return {"method": method, "headers": [(b"authorization", f"Bearer {token}".encode())]}


@pytest.mark.parametrize(
    ("changes", "request_scope", "renewed"),
    [
        ({}, scope(TOKEN), True),
        ({}, scope("another-token"), False),
        ({}, scope(TOKEN, "GET"), False),
        ({"lost": True}, scope(TOKEN), False),  # a lost node comes back through its report
        ({"heard_ago": timedelta(minutes=5)}, scope(TOKEN), False),
        ({"last_heartbeat": None}, scope(TOKEN), False),
    ],
)
def test_a_whole_report_renews_its_node_before_it_goes_to_the_web(
    changes: dict[str, Any],
    request_scope: dict[str, Any],
    renewed: bool,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 3600  # held in memory; nothing written here
    changes = dict(changes)
    ago = changes.pop("heard_ago", timedelta(seconds=2))
    copy = rows(**{"last_heartbeat": timezone.now() - ago, **changes})
    table = NodeTable()
    table.rows, table.lost_after = copy, 30.0
    table.ready.set()
    table._started = True  # no reading thread in this test
    taken: list[int] = []
    held(table, monkeypatch, taken).note_alive(request_scope)
    assert taken == ([7] if renewed else [])


def test_a_renewal_the_web_answers_renews_its_node_here_and_reaches_the_web_whole(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose generation moved (a replica placed on it) sends a renewal the web answers
    with its orders. While thousands of nodes do at once, the web takes a while; the node is
    alive meanwhile, so the gateway renews it as it renews a whole report's node. Without this,
    placing 20,000 replicas on 5,000 nodes marked nodes lost by the hundred (bench/fleet.py)."""
    import asyncio

    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 3600  # held in memory; nothing written here
    table = NodeTable()
    table.rows = rows(last_heartbeat=timezone.now() - timedelta(seconds=2))
    table.lost_after = 30.0
    table.ready.set()
    table._started = True  # no reading thread in this test
    taken: list[int] = []
    process = held(table, monkeypatch, taken)
    sent = body(generation=2)
    forwarded: list[bytes] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": sent, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"the gateway answered it itself: {message}")

    async def to_web(replay: Any) -> None:
        forwarded.append((await replay())["body"])

    asyncio.run(process.renew(scope(TOKEN), receive, send, to_web))
    assert forwarded == [sent] and taken == [7]
    # A token not held renews nothing (the web answers 401, or knows a node newer than the copy).
    taken.clear()
    forwarded.clear()
    asyncio.run(process.renew(scope("llmgw-node-other"), receive, send, to_web))
    assert forwarded == [sent] and taken == []


def test_past_its_room_the_node_gate_queues_briefly_then_answers_503_and_lets_the_next_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thousands of nodes reporting at once: past NODE_REQUESTS a process has on their way to the
    web, a node waits for a place, first come first served, but only within the queue's bound and
    for at most its wait; past either it is told to come back (503, Retry-After), instead of
    waiting in the gateway past its own timeout while the web answers requests nobody waits for
    any more. A place is a node's, one at most: a client whose token is no node's passes beside
    the gate (it cannot fill it with slow bodies), and a node already in is told to come back."""
    import asyncio

    from gateway.metrics import metrics

    table = NodeTable()
    table.rows = {
        bearer.digest(f"llmgw-node-{n}"): NodeRow(pk, n, 3, False, DIGEST, NOW.timestamp())
        for pk, n in enumerate("abcdefg", start=1)
    }

    async def run() -> tuple[list[dict[str, Any]], list[str]]:
        gate = renewals.NodeGate(table, RenewalDoor(metrics()), limit=2, queue=1, wait=0.3)
        done = {name: asyncio.Event() for name in "abcdefgx"}
        reached: list[str] = []
        answers: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            answers.append(message)

        def to_web(name: str) -> Any:
            async def go() -> None:
                reached.append(name)
                await done[name].wait()

            return go

        def through(name: str, token: str | None = None) -> Any:
            return asyncio.ensure_future(
                gate.through(scope(token or f"llmgw-node-{name}"), send, to_web(name))
            )

        a, b = through("a"), through("b")
        await asyncio.sleep(0)  # yield to the loop
        assert gate.held == 2 and reached == ["a", "b"]
        c = through("c")
        await asyncio.sleep(0)  # yield to the loop
        assert gate.queued == 1 and "c" not in reached  # waits for a place
        await through("d")  # the queue is full: told to come back at once
        stranger = through("x", token="no-node-of-ours")
        await asyncio.sleep(0)  # yield to the loop
        assert "x" in reached and gate.held == 2  # beside the gate, not in it
        done["a"].set()
        await a
        await wait_for_async(
            lambda: reached[-1] == "c", timeout=5, what="c let in to the place a handed on"
        )
        assert reached[-1] == "c" and gate.held == 2 and gate.queued == 0  # a's place, handed on
        await through("c")  # the same node, while its first request is in: told to come back
        started = time.monotonic()
        await through("e")  # no place within the wait: told to come back
        assert 0.25 < time.monotonic() - started < 2
        # A client that goes away while it waits leaves neither a place nor its turn behind.
        f = through("f")
        await asyncio.sleep(0)  # yield to the loop
        f.cancel()
        await asyncio.gather(f, return_exceptions=True)
        assert gate.queued == 0 and gate.nodes == {2, 3}
        g = through("g")
        await asyncio.sleep(0)  # yield to the loop
        for name in "bcgx":
            done[name].set()
        await asyncio.gather(b, c, g, stranger)
        assert gate.held == 0 and gate.queued == 0 and not gate.nodes
        return answers, reached

    shed = metrics().node_requests_shed._value.get()
    answers, reached = asyncio.run(run())
    assert reached == ["a", "b", "x", "c", "g"]
    start = answers[0]
    assert start["status"] == 503
    assert (b"retry-after", str(renewals.RETRY_AFTER_SECONDS).encode()) in start["headers"]
    assert b"nodes_busy" in b"".join(m.get("body", b"") for m in answers)
    assert [m["status"] for m in answers if "status" in m] == [503, 503, 503]
    assert metrics().node_requests_shed._value.get() == shed + 3


def test_the_node_gates_of_the_run_commands_gateway_leave_the_web_threads_for_people() -> None:
    """Nodes' requests in flight to the web over all the gateway's processes stay below the
    web's threads, with some to spare: people's requests (and the reconciler's reads of a model's
    header from the mirror) otherwise wait in gunicorn's backlog behind thousands of nodes'."""
    from llmgw_site.management.commands import llmgw_run

    threads = llmgw_run.WEB_WORKERS * llmgw_run.WEB_THREADS
    nodes = renewals.NODE_REQUESTS * llmgw_run.GATEWAY_WORKERS
    assert nodes <= threads - 4, (nodes, threads)
    command = llmgw_run.web_command(Path("/bin"), "127.0.0.1:1", timeout=30)
    assert command[command.index("--threads") + 1] == str(llmgw_run.WEB_THREADS)
    assert command[command.index("--workers") + 1] == str(llmgw_run.WEB_WORKERS)


def test_the_gateway_answers_renewals_by_its_own_renewals_and_forwards_nodes_as_nodes(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway process holds its Renewals (gateway.process.Gateway): a current renewal is
    answered from its copy, and a report or a renewal the web answers is forwarded as a held
    node's (its body in the reserve, gateway.webforward), a stranger's as anyone's."""
    import asyncio

    from gateway import app
    from gateway.process import Gateway

    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 3600  # held in memory; nothing written here
    application = app.Application()
    gateway = application.gateway = Gateway()
    table = gateway.renewals.table
    table.rows, table.lost_after = rows(last_heartbeat=timezone.now()), 30.0
    table.ready.set()
    table._started = True  # no reading thread in this test
    taken: list[int] = []
    monkeypatch.setattr(gateway.renewals.liveness, "renewed", lambda pk, at: taken.append(pk))
    forwarded: list[bool] = []

    async def forward(*args: Any, node: bool = False) -> None:
        forwarded.append(node)

    monkeypatch.setattr(app, "forward", forward)
    answers: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        answers.append(message)

    def post(path: str, sent: bytes, token: str = TOKEN) -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": sent, "more_body": False}

        request = {"type": "http", "path": path, **scope(token)}
        asyncio.run(application(request, receive, send))

    post(renewals.PATH, body())
    assert answers[0]["status"] == 200 and json.loads(answers[-1]["body"])["changed"] is False
    assert taken == [7] and forwarded == []
    post(renewals.REPORT_PATH, b"{}")
    post(renewals.PATH, body(generation=2))
    post(renewals.REPORT_PATH, b"{}", token="llmgw-node-other")
    assert forwarded == [True, True, False]
