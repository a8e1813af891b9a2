"""Node renewals answered by the gateway itself, without the hop to the web process.

A renewal (POST /api/v1/node/renew, fleet.services.node_renew) is the heartbeat of a node on
which nothing changed: in a large fleet, nearly every request the control plane gets. Each
gateway process holds a copy of every node's few facts that decide one (`NodeTable`), answers
the common case, "nothing changed", as node_renew would, and passes anything else to the web,
through a gate that sheds nodes' requests rather than queue them without end (`NodeGate`).
Fleet's rules, run in the gateway's process, which lends them a `Door`: nothing here imports
the gateway. Why, and the figures: docs/scaling.md#a-fleet-of-thousands-of-nodes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

from django.db import close_old_connections, connection
from django.utils import timezone

from catalog.config import current_config
from core.metrics import control_metrics
from llmgw import bearer

from .liveness import Liveness, flush_seconds
from .services import interval_for, renewal_wants_report, unchanged_answer

log = logging.getLogger("llmgw.gateway")

# ASGI's shapes, as the server hands them.
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

PATH = "/api/v1/node/renew"
REPORT_PATH = "/api/v1/node/heartbeat"
# How old the copy of the nodes may be: a generation moved meanwhile (a replica placed on the
# node) reaches the node at its next renewal, one interval later. Nothing is lost, since the node
# keeps naming the generation it acted on until an answer moves it.
READ_SECONDS = 1.0
# A renewal's body is read up to this many bytes (within the body timeout every request has);
# a longer one goes to the web as it came.
MAX_BODY = 4096
# Nodes' requests one gateway process has on their way to the web at once (in flight, or waiting
# for one of its WEB_CONNECTIONS); past it they queue (NODE_QUEUE), then are answered 503 with
# Retry-After, their node renewed first (`NodeGate`). Fewer than the web has threads over all
# the gateway's processes (the run command: 2 x 12 of gunicorn's 2 x 16), so that people's
# requests (the console, the API, the reconciler reading a model's header from the mirror) find
# a thread free: at 24 a process and 2 x 8 threads, the web's threads all held nodes' requests
# while thousands of nodes reported, and each header read of a reconcile pass waited seconds in
# gunicorn's backlog behind them (a pass placing 20,000 replicas began 10-20 s after the models
# were added).
NODE_REQUESTS = 12
# Past NODE_REQUESTS, up to NODE_QUEUE more nodes' requests a process wait for a place, in
# arrival order, for at most QUEUE_SECONDS (well inside the agent's 10 s timeout: the web never
# answers a request its node stopped waiting for); past either, 503 with Retry-After at once,
# the node's liveness already noted: the web then spends its time on requests whose node still
# waits, a node's retry finds the queue shorter, and people's requests to the web keep the rest
# of the gateway's connections to it.
NODE_QUEUE = 96
QUEUE_SECONDS = 1.0
RETRY_AFTER_SECONDS = 5


class Figures(Protocol):
    """The data plane's figures of the renewals (llmgw_gateway_nodes_held, ..._node_requests_*)."""

    @property
    def nodes_held(self) -> Any: ...  # a gauge: set()

    @property
    def node_requests_waiting(self) -> Any: ...  # a gauge: inc(), dec()

    @property
    def node_requests_queued(self) -> Any: ...  # a gauge: inc(), dec()

    @property
    def node_requests_shed(self) -> Any: ...  # a counter: inc()


class Door(Protocol):
    """What the process that serves the renewals lends them (gateway.process.RenewalDoor): its
    way of reading a request and answering it, in its own words, and its figures."""

    @property
    def figures(self) -> Figures: ...

    def header(self, scope: Scope, name: bytes) -> str:
        """The request's header `name` (lower case), "" when it has none."""
        ...

    async def read_body(self, receive: Receive, send: Send, limit: int) -> bytes | None:
        """The request's body, at most `limit` bytes; None when the client was answered instead
        (too large, too slow) or went away."""
        ...

    async def answer(self, send: Send, status: int, body: bytes) -> None:
        """Answer `body` (JSON) whole."""
        ...

    async def busy(self, send: Send, retry_after: int) -> None:
        """Answer 503: the web has as many nodes' requests as it takes; come back in
        `retry_after` seconds."""
        ...


class NodeRow(NamedTuple):
    pk: int
    name: str
    generation: int
    lost: bool
    report_digest: str
    heard: float | None  # last_heartbeat, in seconds since the epoch

    @property
    def last_heartbeat(self) -> datetime | None:
        return None if self.heard is None else datetime.fromtimestamp(self.heard, UTC)


# last_heartbeat as seconds since the epoch, computed by the database: the table is read whole
# every second, and making 5,000 aware datetimes of it (Django's loader, then a check that each
# is aware) was two thirds of a read's 39 ms; the whole read now takes 14 ms, the event loop's
# GIL held that much less each second.
HEARD = {
    "postgresql": "EXTRACT(EPOCH FROM last_heartbeat)::float8",
    "sqlite": "(julianday(last_heartbeat) - 2440587.5) * 86400.0",
}


class NodeTable:
    """Every node's row by its token's digest, read whole every READ_SECONDS by a thread of its
    own, started by the first renewal. One row per node of the database
    (llmgw_gateway_nodes_held)."""

    def __init__(self, figures: Figures | None = None) -> None:
        self.figures = figures
        self.rows: Mapping[str, NodeRow] = {}
        self.lost_after = 30.0
        self.ready = threading.Event()
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._run, name="node-table", daemon=True).start()

    def read(self) -> None:
        """Read the table again (one query), replacing the copy whole."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT token_hash, id, name, generation, lost, report_digest, "
                f"{HEARD[connection.vendor]} FROM fleet_node"
            )
            held, make = self.rows, NodeRow._make
            rows = {}
            for raw in cursor.fetchall():
                # Most rows are as they were a second ago (a tenth of the nodes renew in one
                # at 5,000): the row held is kept (a NodeRow equals the tuple of its fields).
                row = held.get(raw[0])
                rows[raw[0]] = row if row is not None and row == raw[1:] else make(raw[1:])
        self.rows = rows
        self.lost_after = float(current_config().node_lost_after)
        if self.figures is not None:
            self.figures.nodes_held.set(len(rows))
        self.ready.set()

    def _run(self) -> None:
        while True:
            try:
                close_old_connections()
                self.read()
            except Exception as exc:
                # The database may be away: renewals go to the web, which says so, meanwhile.
                log.warning("gateway: cannot read the nodes for renewals: %s", exc)
                self.rows = {}
                connection.close()
            time.sleep(READ_SECONDS)


def node_of(rows: Mapping[str, NodeRow], authorization: str) -> NodeRow | None:
    """The held row of the node whose token the Authorization header carries (either scheme the
    web's node authentication takes), or None."""
    keyword, _, token = authorization.partition(" ")
    if keyword.lower() not in ("bearer", "token") or not token.strip():
        return None
    return rows.get(bearer.digest(token.strip()))


def held_row(
    rows: Mapping[str, NodeRow], authorization: str, body: bytes, now: datetime, lost_after: float
) -> NodeRow | None:
    """The node's row when this renewal's answer is "nothing changed" and the copy can tell;
    None when the web must answer it."""
    row = node_of(rows, authorization)
    if row is None:
        return None
    try:
        sent = json.loads(body)
    except (ValueError, RecursionError):  # 4 KB of "[" nests deeper than the parser recurses
        return None
    if not isinstance(sent, dict):
        return None
    generation, digest = sent.get("generation"), sent.get("report_digest")
    if isinstance(generation, bool) or not isinstance(generation, int):
        return None
    if not isinstance(digest, str) or generation != row.generation:
        return None
    if renewal_wants_report(
        lost=row.lost,
        last_heartbeat=row.last_heartbeat,
        stored_digest=row.report_digest,
        digest=digest,
        now=now,
        lost_after=lost_after,
    ):
        return None
    return row


class NodeGate:
    """At most NODE_REQUESTS nodes' requests of this process on their way to the web, and one a
    node: a node's room is taken only by a request carrying its token, so a client that is no
    node of the copy (a token not held: the web answers it, 401, 410 for a node removed lately,
    or a node newer than the copy) passes beside the gate, as any other request to the web
    does, and cannot fill it with slow bodies; nor can one node take more than one place. Past
    the room, up to `queue` more wait for a place, first come first served, for at most `wait`
    seconds; past that, or past the queue, 503 with Retry-After."""

    def __init__(
        self,
        table: NodeTable,
        door: Door,
        limit: int = NODE_REQUESTS,
        *,
        queue: int = NODE_QUEUE,
        wait: float = QUEUE_SECONDS,
    ) -> None:
        self.table = table
        self.door = door
        self.limit = limit
        self.queue_limit = queue
        self.wait = wait
        self.nodes: set[int] = set()  # the nodes holding a place or waiting for one
        self.held = 0  # places taken; at most `limit`
        self.queue: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self.queue)

    async def through(self, scope: Scope, send: Send, to_web: Any) -> None:
        """Call `to_web` once the request's node has a place, else answer 503 with Retry-After."""
        row = node_of(self.table.rows, self.door.header(scope, b"authorization"))
        if row is None:
            await to_web()
            return
        if row.pk in self.nodes or (
            self.held >= self.limit and len(self.queue) >= self.queue_limit
        ):
            await self._shed(send)
            return
        self.nodes.add(row.pk)
        try:
            if self.held < self.limit:
                self.held += 1
            elif not await self._wait_for_a_place():
                await self._shed(send)
                return
            self.door.figures.node_requests_waiting.inc()
            try:
                await to_web()
            finally:
                self.door.figures.node_requests_waiting.dec()
                self._hand_on()
        finally:
            self.nodes.discard(row.pk)

    async def _wait_for_a_place(self) -> bool:
        """Whether a place was handed to this request (by _hand_on) within `wait` seconds."""
        handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue.append(handed)
        self.door.figures.node_requests_queued.inc()
        try:
            await asyncio.wait_for(asyncio.shield(handed), self.wait)
            return True
        except TimeoutError:
            return handed.done()  # handed on in the same moment: it is this request's now
        except asyncio.CancelledError:
            if handed.done():
                self._hand_on()  # the client went away holding a place: pass it on
            raise
        finally:
            handed.cancel()  # a no-op once handed
            with contextlib.suppress(ValueError):
                self.queue.remove(handed)
            self.door.figures.node_requests_queued.dec()

    def _hand_on(self) -> None:
        """A place is free: to the first request still waiting, else back to the room."""
        while self.queue:
            first = self.queue.popleft()
            if not first.done():
                first.set_result(None)
                return
        self.held -= 1

    async def _shed(self, send: Send) -> None:
        self.door.figures.node_requests_shed.inc()
        await self.door.busy(send, RETRY_AFTER_SECONDS)


class Renewals:
    """One process's renewals: its copy of the nodes (`table`), its gate to the web (`gate`),
    and the renewals it took, waiting to be written (`liveness`). Made by the data plane as it
    starts (gateway.process.Gateway), which lends it its `door`.

    - A renewal whose node is held, which fleet.services.renewal_wants_report lets through and
      whose generation is the node's, is recorded (fleet.liveness, written once a second) and
      answered here, as node_renew would answer it.
    - Anything else (a token not held, another generation, a report wanted, a body that is not
      a small JSON object) goes to the web as it came, which answers it in full.
    - A whole report (POST /api/v1/node/heartbeat), and a renewal the web must answer, go to the
      web, but renew their node here first (`note_alive`).
    """

    def __init__(
        self, door: Door, *, table: NodeTable | None = None, liveness: Liveness | None = None
    ) -> None:
        self.door = door
        self.table = table if table is not None else NodeTable(door.figures)
        self.gate = NodeGate(self.table, door)
        self.liveness = liveness if liveness is not None else Liveness()

    def from_a_node(self, scope: Scope) -> bool:
        """Whether the request is a node's report or renewal carrying the token of a node this
        process holds: the gate lets at most NODE_REQUESTS of those reach the web at once."""
        if scope["path"] not in (REPORT_PATH, PATH):
            return False
        return node_of(self.table.rows, self.door.header(scope, b"authorization")) is not None

    async def renew(self, scope: Scope, receive: Receive, send: Send, to_web: Any) -> None:
        """Answer the renewal here if it is "nothing changed", else pass it to the web (`to_web`,
        called with a receive that hands the body read here)."""
        self.table.start()
        body = await self.door.read_body(receive, send, MAX_BODY)
        if body is None:
            return
        now = timezone.now()
        rows, lost_after = self.table.rows, self.table.lost_after
        row = None
        if scope["method"] == "POST" and self.table.ready.is_set():
            row = held_row(rows, self.door.header(scope, b"authorization"), body, now, lost_after)
        if row is None:
            # A renewal the web answers (the node's generation moved: a replica placed on it)
            # still says the node is alive, however long the web takes to answer it.
            self.note_alive(scope)
            await self.gate.through(scope, send, lambda: to_web(_replay(body, receive)))
            return
        if flush_seconds() <= 0:
            await asyncio.to_thread(self.liveness.renewed, row.pk, now)
        else:
            self.liveness.renewed(row.pk, now)
        control_metrics().node_heartbeats.labels("renewal", "unchanged").inc()
        answer = unchanged_answer(
            node=row.name,
            interval=interval_for(len(rows), lost_after),
            generation=row.generation,
        )
        await self.door.answer(send, 200, json.dumps(answer).encode())

    def note_alive(self, scope: Scope) -> None:
        """A whole report on its way to the web (POST /api/v1/node/heartbeat), or a renewal the
        web must answer, from a node held here: the node is alive whatever becomes of the
        request, so it is renewed now. When thousands of nodes report at once (a model of
        thousands of replicas placed) the web takes a while to answer them all; without this, a
        node whose reports waited past node_lost_after would be declared lost for the web's
        slowness, its replicas withdrawn and placed again, and the burst made worse. Only a node
        not lost and heard lately: one coming back goes through the report, which starts its
        heard_since again."""
        self.table.start()
        if scope["method"] != "POST" or not self.table.ready.is_set():
            return
        row = node_of(self.table.rows, self.door.header(scope, b"authorization"))
        if row is None or row.lost or row.last_heartbeat is None:
            return
        now = timezone.now()
        if (now - row.last_heartbeat).total_seconds() > self.table.lost_after:
            return
        if flush_seconds() > 0:  # else the report's own write is enough
            self.liveness.renewed(row.pk, now)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read, then whatever the client sends next."""
    given = False

    async def again() -> Any:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
