"""Fair queueing: when every slot of a model is busy, requests wait here, and each freed slot goes
to the next one in weighted-fair order between teams, then people, then keys.

Without it a request that finds every slot busy waits in the engine's own first-come queue,
behind however many streams another key holds. Here a freed slot goes to the waiter furthest
behind its fair share (start-time fair queueing: `FairQueue`), in one order over every gateway
process of the machine, each writing its waiters to a board of its own (`_Board`) and taking
free slots under one lock (`_GrantLock`). The order, the bounds and what happens when a process
dies or stalls: docs/sharing.md#how-the-fair-queue-works.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import heapq
import itertools
import math
import os
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from . import boards, conf, errors
from .routing import Balancer, Candidate, Hold

# How long the first waiter, on another process, has to take a freed slot before this
# process's own head takes it: longer than that process's poll and a loaded event loop's
# usual lag, short beside an answer (a slot idles at most this long per grant).
GRACE_SECONDS = 0.05
# How often a process with waiters looks for slots freed by the other processes (its own
# frees wake it at once).
POLL_SECONDS = 0.01
# A process whose waiters have not written its heartbeat for this long is not waited for
# (counted in this process's own beats: see gateway.boards.PAUSE_SECONDS).
STALE_SECONDS = 1.0
# Requests, waiting or in service, one process's file holds.
ENTRIES = 8192
# Models' queues a process keeps (one per model asked for); past this, the idle ones are dropped.
MAX_QUEUES = 1024
# Buckets of the per-model count of waiters each file keeps, so a reader skips a scan.
BUCKETS = 1024
# Entries of those who left (timed out, hung up) or were served out of order that a model's
# heap may keep beyond twice its waiters before it is built again without them.
HEAP_SLACK = 64
# The smallest weight taken: a weight of 0 would give a flow an infinite finish tag.
MIN_WEIGHT = 0.01
# The smallest share a flow gets (a team's weight split between many people and their keys).
MIN_SHARE = 1e-6
# Bounds of the Retry-After sent with a refusal.
RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1, 60

# A board's body: the entries in use (the high water), BUCKETS counts of waiters, ENTRIES entries.
_LAYOUT = 1
_USED = struct.Struct("<q")
_BUCKET = struct.Struct("<q")
# model hash, flow (key), member (user) and top (team, or the user) hashes, start, finish, the
# key's weight, the person's, arrival ns, state
_ENTRY = struct.Struct("<qqqqddddqq")
_TAGS = struct.Struct("<dd")
_TAGS_OFFSET, _ORDER_OFFSET, _STATE_OFFSET = 32, 64, 72
_BUCKETS_AT = 64
_ENTRIES_AT = _BUCKETS_AT + BUCKETS * _BUCKET.size
BOARD_BYTES = _ENTRIES_AT + ENTRIES * _ENTRY.size

FREE, WAITING, SERVED = 0, 1, 2
# A flow's, its member's and its top's hashes.
Hashes = tuple[int, int, int]


def name_hash(*parts: str) -> int:
    """A stable 64-bit hash (never 0, which marks a free entry) of a model or a flow."""
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


@dataclass(frozen=True)
class Who:
    """Whose share a request counts against, level by level: its key (the flow), the key's
    owner (a key without a known owner is a person of its own), and the owner's team (or,
    without one, the owner again)."""

    flow: str
    member: str
    top: str


def who_of(key_id: int | None, user_id: int | None, team_id: int | None) -> Who:
    flow = f"key:{key_id}"
    member = f"user:{user_id}" if user_id is not None else flow
    return Who(flow, member, f"team:{team_id}" if team_id is not None else member)


def share(
    team_weight: float | None,
    person: float | None,
    others: Iterable[float],
    key_weights: Sequence[float],
) -> float:
    """A member's weight in the order between members. In a team: the team's weight, split
    between its people in use by their weights (`person`, this one's, and `others`; 1 where
    staff set none). Without one: the person's weight, or where staff set none their heaviest
    key's in use (`key_weights`). A person's sixteen keys get one person's share, not sixteen;
    between them, each turn of the person's goes by the keys' weights (_Inner)."""
    mine = person if person is not None else 1.0
    if team_weight is not None:
        return max(MIN_SHARE, team_weight * mine / (mine + sum(others)))
    return max(MIN_SHARE, person if person is not None else max(key_weights))


# -- refusals -----------------------------------------------------------------------------


class QueueFull(Exception):
    """As many requests wait for the model as the queue holds: 429."""

    def __init__(self, model: str, waiting: int, limit: int, retry_after: int, why: str) -> None:
        super().__init__(f"{model}: {waiting} waiting, limit {limit}")
        self.model, self.waiting, self.limit = model, waiting, limit
        self.retry_after, self.why = retry_after, why

    def refusal(self) -> errors.Refusal:
        return errors.openai_error(
            429,
            f"Every slot of {self.model} is busy and {self.why}. Try again shortly; the "
            "Retry-After header says when. More replicas of the model take more at once.",
            code="queue_full",
            kind="rate_limit_exceeded",
            headers={"Retry-After": str(self.retry_after)},
        )


class QueueTimeout(Exception):
    """The request waited as long as it may: 503."""

    def __init__(self, model: str, waited: float, retry_after: int) -> None:
        super().__init__(f"{model}: waited {waited:.1f}s")
        self.model, self.waited, self.retry_after = model, waited, retry_after

    def refusal(self) -> errors.Refusal:
        return errors.openai_error(
            503,
            f"Every slot of {self.model} stayed busy for the {self.waited:.0f} seconds a request "
            "may wait in the gateway's queue (LLMGW_QUEUE_TIMEOUT). Try again; the Retry-After "
            "header says when.",
            code="queue_timeout",
            kind="server_error",
            headers={"Retry-After": str(self.retry_after)},
        )


class ClientGone(Exception):
    """The client hung up while its request waited; nothing is left to answer."""


async def client_gone(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
    """Returns when an ASGI client has hung up (for `turn(hangup=...)`, once the body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# -- the shared board ---------------------------------------------------------------------


@dataclass
class _Scan:
    """What every process's board says about one model (and one request's flow, member and top
    of it)."""

    waiting: int = 0
    least_waiting_start: float = math.inf
    most_served_start: float = -math.inf
    member_finish: float = -math.inf
    flow_waiting: int = 0
    member_waiting: int = 0
    # In use (waiting or in service): the top's members, and the member's keys with their weights.
    members: dict[int, float] = field(default_factory=dict)  # member: its person's weight
    key_weights: dict[int, float] = field(default_factory=dict)

    @property
    def virtual_time(self) -> float:
        """Where a flow that has nothing waiting or in service starts: level with the request
        served last (granted in order, so the first waiter's S is no smaller; when a grant went
        out of order, the first waiter's, so that nobody jumps behind the whole queue)."""
        if self.waiting and self.most_served_start > -math.inf:
            return min(self.least_waiting_start, self.most_served_start)
        if self.waiting:
            return self.least_waiting_start
        return max(0.0, self.most_served_start)


class _Board:
    """This process's waiting and in-service requests, written where the other processes of the
    machine read them (a bytearray of its own when there is no folder)."""

    def __init__(self, folder: Path | None, pid: int) -> None:
        self.shared = boards.Board(folder, "queue", BOARD_BYTES, layout=_LAYOUT, pid=pid)
        self.pid = pid
        self._spare: list[int] = []  # freed entries below the high water, reused first
        self._used = 0
        self.granting = _GrantLock(folder / "grants.lock" if folder is not None else None)

    @property
    def awake(self) -> float:
        """The seconds this process has been running, as its beats tell: what the others'
        heartbeats and a grace are judged by."""
        return self.shared.awake

    # writing (this process only)

    def beat(self, now: float) -> None:
        self.shared.beat(now)

    def add(self, waiter: _Waiter, state: int) -> int | None:
        """Write a waiter's entry; its index, or None when the file is full."""
        if self._spare:
            index = heapq.heappop(self._spare)
        elif self._used < ENTRIES:
            index = self._used
        else:
            return None
        # Everything but the state first: a reader takes an entry by its state.
        at = _ENTRIES_AT + index * _ENTRY.size
        model = waiter.model_hash
        _ENTRY.pack_into(self.shared.body, at, model, waiter.flow_hash, waiter.member_hash,
                         waiter.top_hash, waiter.start, waiter.finish, waiter.weight,
                         waiter.person,
                         waiter.order, FREE)  # fmt: skip
        if state == WAITING:
            self._bucket_add(model, 1)
        _BUCKET.pack_into(self.shared.body, at + _STATE_OFFSET, state)
        if index >= self._used:
            self._used = index + 1
            _USED.pack_into(self.shared.body, 0, self._used)
        self.beat(time.monotonic())
        return index

    def retag(self, waiter: _Waiter) -> None:
        """Write a waiter's new place in the order (start, finish, arrival) over its entry's."""
        at = _ENTRIES_AT + waiter.index * _ENTRY.size  # type: ignore[operator]
        _TAGS.pack_into(self.shared.body, at + _TAGS_OFFSET, waiter.start, waiter.finish)
        _BUCKET.pack_into(self.shared.body, at + _ORDER_OFFSET, waiter.order)

    def serve(self, index: int, model: int) -> None:
        at = _ENTRIES_AT + index * _ENTRY.size + _STATE_OFFSET
        _BUCKET.pack_into(self.shared.body, at, SERVED)
        self._bucket_add(model, -1)

    def remove(self, index: int, model: int) -> None:
        at = _ENTRIES_AT + index * _ENTRY.size + _STATE_OFFSET
        (state,) = _BUCKET.unpack_from(self.shared.body, at)
        _BUCKET.pack_into(self.shared.body, at, FREE)
        if state == WAITING:
            self._bucket_add(model, -1)
        heapq.heappush(self._spare, index)
        if index == self._used - 1:
            # Readers scan up to the high water: bring it down over the free entries on top.
            while self._used and self._state(self._used - 1) == FREE:
                self._used -= 1
            self._spare = [i for i in self._spare if i < self._used]
            heapq.heapify(self._spare)
        _USED.pack_into(self.shared.body, 0, self._used)

    def _state(self, index: int) -> int:
        at = _ENTRIES_AT + index * _ENTRY.size + _STATE_OFFSET
        return int(_BUCKET.unpack_from(self.shared.body, at)[0])

    def _bucket_add(self, model: int, delta: int) -> None:
        at = _BUCKETS_AT + (model % BUCKETS) * _BUCKET.size
        (count,) = _BUCKET.unpack_from(self.shared.body, at)
        _BUCKET.pack_into(self.shared.body, at, max(0, count + delta))

    # reading (every process's board, this one's included)

    def _boards(self, now: float) -> list[tuple[int, Any, bool]]:
        """(pid, body, whether its waiters count) for this process and every live other."""
        shared = self.shared
        shared.rescan(now)
        found: list[tuple[int, Any, bool]] = [(self.pid, shared.body, True)]
        for pid, other in shared.others.items():
            found.append((pid, other.body, shared.fresh(other, now, STALE_SECONDS)))
        return found

    @staticmethod
    def _entries(body: Any) -> Any:
        (used,) = _USED.unpack_from(body, 0)
        used = max(0, min(int(used), ENTRIES))
        return _ENTRY.iter_unpack(bytes(body[_ENTRIES_AT : _ENTRIES_AT + used * _ENTRY.size]))

    @staticmethod
    def _has_waiters(buffer: Any, model: int) -> bool:
        return bool(_BUCKET.unpack_from(buffer, _BUCKETS_AT + (model % BUCKETS) * _BUCKET.size)[0])

    def processes(self) -> int:
        """The gateway processes this board knows of (itself included), as of its last scan."""
        return 1 + len(self.shared.others)

    def others_waiting(self, model: int, now: float) -> bool:
        """Whether another process has requests waiting for the model (or a model that shares
        its bucket: then the caller takes the slower way, which is exact)."""
        return any(
            counts and self._has_waiters(buffer, model)
            for pid, buffer, counts in self._boards(now)
            if pid != self.pid
        )

    def scan(self, model: int, now: float, flow: int = 0, member: int = 0, top: int = 0) -> _Scan:
        found = _Scan()
        for _, buffer, counts in self._boards(now):
            for m, f, u, t, start, finish, weight, person, _, state in self._entries(buffer):
                if m != model or state == FREE:
                    continue
                waiting = state == WAITING
                if waiting:
                    if not counts:
                        continue
                    found.waiting += 1
                    found.least_waiting_start = min(found.least_waiting_start, start)
                elif state == SERVED:
                    found.most_served_start = max(found.most_served_start, start)
                if f == flow:
                    found.flow_waiting += waiting
                if t == top:
                    found.members[u] = person
                if u == member:
                    found.member_finish = max(found.member_finish, finish)
                    found.key_weights[f] = weight
                    found.member_waiting += waiting
        return found

    def others_first(self, model: int, now: float) -> tuple[float, int, int] | None:
        """The first waiter for the model on another process: (start, arrival, pid)."""
        first: tuple[float, int, int] | None = None
        for pid, buffer, counts in self._boards(now):
            if pid == self.pid or not counts or not self._has_waiters(buffer, model):
                continue
            for m, _, _, _, start, _, _, _, order, state in self._entries(buffer):
                if m == model and state == WAITING:
                    mark = (start, order, pid)
                    if first is None or mark < first:
                        first = mark
        return first

    def close(self) -> None:
        self.granting.close()
        self.shared.close()


class _GrantLock:
    """Held while a process decides that a slot is free and counts it for a request: the
    machine's gateway processes take turns at it (flock on a file in the folder, held for one
    grant pass), so two never hand out one slot. Without a folder there is nobody to take turns
    with. A class, not a contextlib generator: the fast path takes it, and that cost 3 µs more."""

    def __init__(self, path: Path | None) -> None:
        self._handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path is not None else None

    def __enter__(self) -> None:
        if self._handle is not None:
            # OSError: closed from another thread at the gateway's stop; nobody's board is read.
            with contextlib.suppress(OSError):
                fcntl.flock(self._handle, fcntl.LOCK_EX)

    def __exit__(self, *exc_info: object) -> None:
        if self._handle is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._handle, fcntl.LOCK_UN)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            os.close(handle)


def waiting_on_machine(folder: Path, models: Sequence[str]) -> dict[str, int]:
    """Requests waiting per model in every live gateway process's queue under `folder`, read
    without a board of one's own (for a process that queues nothing: the web's model page)."""
    hashes = {name_hash(model): model for model in models}
    counts = dict.fromkeys(models, 0)
    now = time.monotonic()
    with boards.reading(folder, "queue", BOARD_BYTES, layout=_LAYOUT) as found:
        for other in found:
            if now - other.heartbeat > STALE_SECONDS:
                continue
            for model_hash, *_, state in _Board._entries(other.body):
                if state == WAITING and model_hash in hashes:
                    counts[hashes[model_hash]] += 1
    return counts


# -- the queue ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Granted:
    """A request's turn: `replica` had the free slot handed to it, counted in `hold` until the
    balancer's choice takes it over (`Balancer.choose(..., hold=granted.hold)`, which picks it
    or another with a slot free); `waited` is the seconds spent queued."""

    replica: Candidate
    waited: float
    queued: bool
    hold: Hold


@dataclass(eq=False)
class _Waiter:
    model: str
    model_hash: int
    flow_hash: int
    member_hash: int
    top_hash: int
    weight: float  # its key's
    person: float  # its person's (1 where staff set none)
    start: float
    finish: float
    order: int
    inner: float  # its tag among its member's requests in this process
    candidates: tuple[Candidate, ...]
    balancer: Balancer
    future: asyncio.Future[Hold]
    index: int | None = None
    hold: Hold | None = None


@dataclass(eq=False)
class _Inner:
    """The order between one member's keys, in this process: start-time fair queueing again,
    one level down. The member's turns come by the order between members; each goes to the
    member's waiter here with the smallest inner tag (see FairQueue._next_of_member)."""

    virtual: float = 0.0
    finish: dict[int, float] = field(default_factory=dict)  # per key

    def tag(self, flow_hash: int, weight: float) -> float:
        start = max(self.virtual, self.finish.get(flow_hash, -math.inf))
        self.finish[flow_hash] = start + 1.0 / weight
        return start


@dataclass(eq=False)
class _ModelQueue:
    """One model's waiters in this process, in fair order, and its dispatcher."""

    name: str
    hash: int
    heap: list[tuple[float, int, int, _Waiter]] = field(default_factory=list)
    waiting: int = 0
    virtual_time: float = 0.0
    # Per member (a person): entries here, and the largest finish tag among them.
    flows: dict[int, tuple[int, float]] = field(default_factory=dict)
    # Who is in use here, for a request that goes straight through (which reads no board):
    # per top, its members' entries; per member, its keys' (entries, weight).
    tops: dict[int, dict[int, tuple[int, float]]] = field(default_factory=dict)
    members: dict[int, dict[int, tuple[int, float]]] = field(default_factory=dict)
    # Per member with requests waiting here: those requests, and the order between its keys.
    waiting_of: dict[int, set[_Waiter]] = field(default_factory=dict)
    inner: dict[int, _Inner] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # When (the board's `awake`) a slot was first seen free for another process's first waiter.
    free_since: float | None = None
    # Seconds between two grants, smoothed: what a refusal's Retry-After is estimated from.
    grant_interval: float = 1.0
    granted_at: float | None = None
    # Waiters per candidate set: with one set (the usual case) only the head can be served.
    sets: dict[tuple[Candidate, ...], int] = field(default_factory=dict)

    def forget_set(self, candidates: tuple[Candidate, ...]) -> None:
        left = self.sets.get(candidates, 0) - 1
        if left > 0:
            self.sets[candidates] = left
        else:
            self.sets.pop(candidates, None)


class FairQueue:
    """The waiting room of one gateway process, in step with the others of the machine."""

    def __init__(
        self,
        folder: Path | None,
        *,
        pid: int | None = None,
        grace: float = GRACE_SECONDS,
        poll: float = POLL_SECONDS,
    ) -> None:
        self.board = _Board(folder, pid if pid is not None else os.getpid())
        self.grace = grace
        self.poll = poll
        self._models: dict[str, _ModelQueue] = {}
        self._sequence = itertools.count()
        # Who asks, and their hashes, by (model, key, owner, team): three hashes a request
        # otherwise. As many as the models' queues (MAX_QUEUES); past that, forgotten at once.
        self._named: dict[tuple[str, int | None, int | None, int | None], tuple[Who, Hashes]] = {}
        # For /metrics: (model, waiting in this process) when that changes; (model, seconds
        # queued, outcome) for every request that asked for a turn, outcome one of "served",
        # "timeout", "full", "gone".
        self.on_depth: Callable[[str, int], None] | None = None
        self.on_wait: Callable[[str, float, str], None] | None = None

    def turn(
        self,
        *,
        model: str,
        key_id: int | None,
        weight: float = 1.0,
        user_id: int | None = None,
        team_id: int | None = None,
        team_weight: float = 1.0,
        user_weight: float | None = None,
        candidates: Sequence[Candidate],
        balancer: Balancer,
        hangup: Callable[[], Awaitable[Any]] | None = None,
        timeout: float | None = None,
        limit: int | None = None,
        per_key: int | None = None,
        per_user: int | None = None,
    ) -> _Turn:
        """``async with queue.turn(...) as granted:`` returns when one of `candidates` has a free
        slot and this request is next in fair order; the request is counted as in service until
        the block ends. Slots are shared between teams (by `team_weight`) and people without
        one, then between a team's people (by `user_weight`, the one staff set), then between a
        person's keys (by their `weight`): see `share`. Raises QueueFull, QueueTimeout, or
        ClientGone when `hangup` returns first. The block's balancer choice takes `granted.hold` (`balancer.choose(..., hold=granted.hold)`), the slot counted
        for it until then; a block that chooses without it counts the request twice until it
        ends."""
        asked = (model, key_id, user_id, team_id)
        named = self._named.get(asked)
        if named is None:
            if len(self._named) >= MAX_QUEUES:
                self._named.clear()
            who = who_of(key_id, user_id, team_id)
            hashes = (name_hash(model, who.flow), name_hash(model, who.member),
                      name_hash(model, who.top))  # fmt: skip
            named = self._named[asked] = (who, hashes)
        return _Turn(
            self,
            model=model,
            who=named[0],
            hashes=named[1],
            weight=max(MIN_WEIGHT, float(weight)),
            team_weight=max(MIN_WEIGHT, float(team_weight)) if team_id is not None else None,
            user_weight=max(MIN_WEIGHT, float(user_weight)) if user_weight is not None else None,
            candidates=tuple(candidates),
            balancer=balancer,
            hangup=hangup,
            timeout=conf.queue_timeout() if timeout is None else timeout,
            limit=conf.queue_max() if limit is None else limit,
            per_key=_bound(per_key, limit, conf.queue_max_per_key),
            per_user=_bound(per_user, limit, conf.queue_max_per_user),
        )

    # figures

    def depths(self) -> dict[str, int]:
        """Requests waiting in this process, per model (summed over processes: the machine's)."""
        return {name: q.waiting for name, q in self._models.items() if q.waiting}

    def depth(self, model: str) -> int:
        """Requests waiting for `model` on this machine, every process's."""
        model_hash = name_hash(model)
        return self.board.scan(model_hash, time.monotonic()).waiting

    def load(self) -> dict[str, tuple[int, list[float]]]:
        """Per model with requests in this process: (requests in service, the seconds each
        waiting request has waited so far). Read by the state refresher's thread (the
        autoscaler's figures, gateway.loadsignal): everything it walks is copied first, each
        copy one step the event loop cannot interleave."""
        now = time.monotonic_ns()
        figures = {}
        for q in list(self._models.values()):
            ages = [
                (now - entry[3].order) / 1e9 for entry in list(q.heap) if not entry[3].future.done()
            ]
            entries = sum(e for e, _ in list(q.flows.values()))  # waiting or in service
            in_service = max(0, entries - q.waiting)
            if in_service or ages:
                figures[q.name] = (in_service, ages)
        return figures

    def size(self) -> tuple[int, int]:
        """(models' queues, flows) this process holds (see the module's Bounds): for /metrics,
        one pass over the models."""
        queues = list(self._models.values())
        return len(queues), sum(len(q.flows) for q in queues)

    def close(self) -> None:
        """Take this process's board away (at its stop, from any thread: no task is touched;
        requests still waiting end with the process)."""
        self.board.close()

    # the way in

    async def _enter(self, ticket: _Turn) -> tuple[_Waiter, Granted]:
        arrived = time.monotonic()
        q = self._queue(ticket.model)
        hashes = ticket.hashes
        flow_hash, member_hash, top_hash = hashes
        hold = None if q.waiting else self._through(q, ticket, arrived)
        if hold is not None:
            # Nobody waits anywhere: straight through, tagged from what this process knows.
            start = max(q.virtual_time, q.flows.get(member_hash, (0, -math.inf))[1])
            weight = ticket.share(q.tops.get(top_hash, {}), q.members.get(member_hash, {}))
            waiter = self._waiter(q, ticket, start, weight, 0.0)
            waiter.hold = hold
            waiter.index = self.board.add(waiter, SERVED)
            if waiter.index is not None:
                self._count_flow(q, waiter, 1)
            q.virtual_time = max(q.virtual_time, start)
            self._observe(ticket.model, 0.0, "served")
            return waiter, Granted(hold.replica, 0.0, queued=False, hold=hold)

        found = self.board.scan(q.hash, arrived, *hashes)
        self._check_room(q, ticket, found)
        local_finish = q.flows.get(member_hash, (0, -math.inf))[1]
        start = max(found.virtual_time, found.member_finish, local_finish)
        weight = ticket.share(found.members, found.key_weights)
        inner = q.inner.setdefault(member_hash, _Inner()).tag(flow_hash, ticket.weight)
        waiter = self._waiter(q, ticket, start, weight, inner)
        waiter.index = self.board.add(waiter, WAITING)
        if waiter.index is None:
            self._observe(ticket.model, 0.0, "full")
            raise QueueFull(
                ticket.model,
                found.waiting,
                ticket.limit,
                self._retry_after(q, found.waiting),
                f"this gateway process holds as many requests as it can track ({ENTRIES})",
            )
        self._count_flow(q, waiter, 1)
        heapq.heappush(q.heap, (waiter.start, waiter.order, next(self._sequence), waiter))
        q.waiting_of.setdefault(member_hash, set()).add(waiter)
        q.waiting += 1
        q.sets[waiter.candidates] = q.sets.get(waiter.candidates, 0) + 1
        self._depth_changed(q)
        self._start_dispatch(q)
        try:
            hold = await self._granted(waiter, ticket, arrived)
        except BaseException as exc:
            outcome = "timeout" if isinstance(exc, TimeoutError) else "gone"
            self._abandon(q, waiter)
            self._observe(ticket.model, time.monotonic() - arrived, outcome)
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(
                    ticket.model, ticket.timeout, self._retry_after(q, q.waiting)
                ) from None
            raise
        waiter.hold = hold
        waited = time.monotonic() - arrived
        self._observe(ticket.model, waited, "served")
        return waiter, Granted(hold.replica, waited, queued=True, hold=hold)

    def _check_room(self, q: _ModelQueue, ticket: _Turn, found: _Scan) -> None:
        """QueueFull when the model's queue on this machine, or the share of it one key or one
        person may take, is full: one person cannot fill a model's queue for everyone else."""
        bounds = [
            (found.waiting, ticket.limit, "LLMGW_QUEUE_MAX",
             "requests already wait for it on this machine, as many as its queue holds"),
            (found.flow_waiting, ticket.per_key, "LLMGW_QUEUE_MAX_PER_KEY",
             "requests of this key already wait for it, as many as one key may"),
        ]  # fmt: skip
        if ticket.who.member != ticket.who.flow:
            bounds.append((found.member_waiting, ticket.per_user, "LLMGW_QUEUE_MAX_PER_USER",
                           "requests of this key's owner already wait for it, as many as one "
                           "person may"))  # fmt: skip
        for waiting, bound, setting, words in bounds:
            if waiting >= bound:
                self._observe(ticket.model, 0.0, "full")
                raise QueueFull(ticket.model, waiting, bound,
                                self._retry_after(q, found.waiting),
                                f"{waiting} {words} ({setting}={bound})")  # fmt: skip

    def _through(self, q: _ModelQueue, ticket: _Turn, now: float) -> Hold | None:
        """A slot held for a request that finds one free and nobody waiting anywhere."""
        balancer, board = ticket.balancer, self.board
        if board.others_waiting(q.hash, now):
            return None
        free, room = self._room(ticket.candidates, balancer, now)
        if free is not None and room >= board.processes():
            # Without the lock: a process grants one slot at a time (looking and counting it
            # with no await between), so while the replica has a free slot for every gateway
            # process, all of them granting at this instant still fit. The usual case of a
            # model with room to spare costs no flock.
            return balancer.hold(free)
        with board.granting:
            free = self._free(ticket.candidates, balancer, now)
            if free is None or board.others_waiting(q.hash, now):
                return None
            return balancer.hold(free)

    async def _granted(self, waiter: _Waiter, ticket: _Turn, arrived: float) -> Hold:
        async with asyncio.timeout(ticket.timeout):
            if ticket.hangup is None:
                return await waiter.future
            gone = asyncio.ensure_future(ticket.hangup())
            try:
                await asyncio.wait({waiter.future, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if waiter.future.done() and not waiter.future.cancelled():
                return waiter.future.result()
            raise ClientGone()

    def _abandon(self, q: _ModelQueue, waiter: _Waiter) -> None:
        """The waiter leaves without being served: out of the queue now, and a slot granted to
        it in that instant is passed on."""
        if waiter.future.done() and not waiter.future.cancelled():
            waiter.balancer.give_back(waiter.future.result())
        else:
            waiter.future.cancel()
            q.waiting -= 1
            q.forget_set(waiter.candidates)
            _stop_waiting(q, waiter)
            # Left in the heap, skipped when it comes up: removing from the middle costs O(n).
            # Until those who left are most of it: the heap is built again without them then
            # (O(n) once per n leaving, so still O(1) each). Else a replica busy for long, its
            # waiters timing out one after another, would grow it by every request that came.
            if len(q.heap) > 2 * q.waiting + HEAP_SLACK:
                q.heap = [entry for entry in q.heap if not entry[3].future.done()]
                heapq.heapify(q.heap)
            self._depth_changed(q)
        self._leave(q, waiter)

    def _leave(self, q: _ModelQueue, waiter: _Waiter) -> None:
        if waiter.index is not None:
            self.board.remove(waiter.index, q.hash)
            waiter.index = None
            self._count_flow(q, waiter, -1)
        q.wake.set()

    # the way out

    def _exit(self, waiter: _Waiter) -> None:
        if waiter.hold is not None and not waiter.hold.taken:
            waiter.balancer.give_back(waiter.hold)  # the block chose no replica
        q = self._models.get(waiter.model)
        if q is not None:
            self._leave(q, waiter)

    # the dispatcher: one task per model with waiters in this process

    def _start_dispatch(self, q: _ModelQueue) -> None:
        q.wake.set()
        if q.task is None or q.task.done():
            q.task = asyncio.get_running_loop().create_task(self._dispatch(q))

    async def _dispatch(self, q: _ModelQueue) -> None:
        while q.waiting:
            q.wake.clear()
            now = time.monotonic()
            self.board.beat(now)
            self.grant(q, now)
            if not q.waiting:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll):
                    await q.wake.wait()
        q.free_since = None

    def grant(self, q: _ModelQueue, now: float) -> None:
        """Hand the free slots to this process's waiters while it is their turn."""
        with self.board.granting:
            self._grant(q, now)

    def _grant(self, q: _ModelQueue, now: float) -> None:
        while q.waiting:
            while q.heap and q.heap[0][3].future.done():
                heapq.heappop(q.heap)  # left (hung up, timed out) while it waited
            if not q.heap:
                return
            head = q.heap[0][3]
            free = self._free(head.candidates, head.balancer, now)
            chosen = head
            if free is None and len(q.sets) > 1:
                # The head's replicas are all busy (an adapter's, a canary's share): a waiter
                # further back whose replicas have a slot free takes it, so none idles.
                chosen, free = self._first_that_fits(q, now)
            if free is None:
                q.free_since = None
                return
            if chosen is head:
                if not self._my_turn(q, head, now):
                    return
                chosen = self._next_of_member(q, head)
            self._hand_over(q, chosen, free, now)

    def _my_turn(self, q: _ModelQueue, head: _Waiter, now: float) -> bool:
        first = self.board.others_first(q.hash, now)
        if first is None or (head.start, head.order, self.board.pid) < first:
            return True
        # The first waiter is on another process: its turn, for GRACE_SECONDS of this one's.
        if q.free_since is None:
            q.free_since = self.board.awake
        return self.board.awake - q.free_since >= self.grace

    def _next_of_member(self, q: _ModelQueue, head: _Waiter) -> _Waiter:
        """The head's member's turn goes to its waiter here that is first between its keys
        (the smallest inner tag, among those the same replicas serve); that waiter and the head
        swap their places in the order between members."""
        best = head
        for waiter in q.waiting_of.get(head.member_hash, ()):
            if waiter.candidates == head.candidates and (waiter.inner, waiter.order) < (
                best.inner,
                best.order,
            ):
                best = waiter
        if best is head:
            return head
        heapq.heappop(q.heap)  # the head's entry; the best's stays, skipped once it is served
        head.start, best.start = best.start, head.start
        head.finish, best.finish = best.finish, head.finish
        head.order, best.order = best.order, head.order
        for waiter in (head, best):
            if waiter.index is not None:
                self.board.retag(waiter)
        heapq.heappush(q.heap, (head.start, head.order, next(self._sequence), head))
        return best

    def _first_that_fits(self, q: _ModelQueue, now: float) -> tuple[_Waiter, Candidate | None]:
        seen: dict[tuple[Candidate, ...], Candidate | None] = {}
        for _, _, _, waiter in heapq.nsmallest(64, q.heap):
            if waiter.future.done():
                continue
            if waiter.candidates not in seen:
                seen[waiter.candidates] = self._free(waiter.candidates, waiter.balancer, now)
            free = seen[waiter.candidates]
            if free is not None:
                return waiter, free
        return q.heap[0][3], None

    def _hand_over(self, q: _ModelQueue, waiter: _Waiter, replica: Candidate, now: float) -> None:
        # Its place in the heap is skipped when it comes up (its future is done).
        q.waiting -= 1
        q.forget_set(waiter.candidates)
        _stop_waiting(q, waiter)
        inner = q.inner.get(waiter.member_hash)
        if inner is not None:
            inner.virtual = max(inner.virtual, waiter.inner)
        q.free_since = None
        q.virtual_time = max(q.virtual_time, waiter.start)
        if q.granted_at is not None:
            q.grant_interval = 0.8 * q.grant_interval + 0.2 * max(0.001, now - q.granted_at)
        q.granted_at = now
        # Counted in flight, where every process sees it, from now until the request's own
        # task runs and has the balancer choose (which takes the hold over): else this loop, or
        # another process, would hand the same slot out twice.
        hold = waiter.balancer.hold(replica)
        if waiter.index is not None:
            self.board.serve(waiter.index, q.hash)
        waiter.future.set_result(hold)
        self._depth_changed(q)

    # small parts

    def _queue(self, model: str) -> _ModelQueue:
        q = self._models.get(model)
        if q is None:
            if len(self._models) >= MAX_QUEUES:
                # Models come and go from the catalog: keep those with anything under way.
                self._models = {
                    name: kept
                    for name, kept in self._models.items()
                    if kept.waiting
                    or kept.flows
                    or (kept.task is not None and not kept.task.done())
                }
            q = self._models[model] = _ModelQueue(model, name_hash(model))
        return q

    def _waiter(
        self, q: _ModelQueue, ticket: _Turn, start: float, share: float, inner: float
    ) -> _Waiter:
        flow_hash, member_hash, top_hash = ticket.hashes
        return _Waiter(
            model=ticket.model,
            model_hash=q.hash,
            flow_hash=flow_hash,
            member_hash=member_hash,
            top_hash=top_hash,
            weight=ticket.weight,
            person=ticket.user_weight if ticket.user_weight is not None else 1.0,
            start=start,
            finish=start + 1.0 / share,
            order=time.monotonic_ns(),
            inner=inner,
            candidates=ticket.candidates,
            balancer=ticket.balancer,
            future=asyncio.get_running_loop().create_future(),
        )

    def _free(
        self, candidates: Sequence[Candidate], balancer: Balancer, now: float
    ) -> Candidate | None:
        """The candidate with the most slots free (grants not yet sent count as busy); None
        when none has one."""
        return self._room(candidates, balancer, now)[0]

    @staticmethod
    def _room(
        candidates: Sequence[Candidate], balancer: Balancer, now: float
    ) -> tuple[Candidate | None, int]:
        """_free's candidate, and how many slots it has free."""
        best: Candidate | None = None
        best_busy = 0
        for candidate in candidates:
            busy = balancer.load.total(candidate.id, now) - candidate.slots
            if busy < best_busy:
                best, best_busy = candidate, busy
        return best, -best_busy

    def _count_flow(self, q: _ModelQueue, waiter: _Waiter, delta: int) -> None:
        entries, finish = q.flows.get(waiter.member_hash, (0, -math.inf))
        entries += delta
        if entries > 0:
            q.flows[waiter.member_hash] = (entries, max(finish, waiter.finish))
        else:
            q.flows.pop(waiter.member_hash, None)
            q.inner.pop(waiter.member_hash, None)
        members = q.tops.setdefault(waiter.top_hash, {})
        entries = members.get(waiter.member_hash, (0, 0.0))[0] + delta
        if entries > 0:
            members[waiter.member_hash] = (entries, waiter.person)
        else:
            members.pop(waiter.member_hash, None)
            if not members:
                del q.tops[waiter.top_hash]
        keys = q.members.setdefault(waiter.member_hash, {})
        entries = keys.get(waiter.flow_hash, (0, 0.0))[0] + delta
        if entries > 0:
            keys[waiter.flow_hash] = (entries, waiter.weight)
        else:
            keys.pop(waiter.flow_hash, None)
            if not keys:
                del q.members[waiter.member_hash]

    def _retry_after(self, q: _ModelQueue, ahead: int) -> int:
        seconds = math.ceil(max(1, ahead) * q.grant_interval)
        return max(RETRY_AFTER_MIN, min(RETRY_AFTER_MAX, seconds))

    def _depth_changed(self, q: _ModelQueue) -> None:
        if self.on_depth is not None:
            self.on_depth(q.name, q.waiting)

    def _observe(self, model: str, seconds: float, outcome: str) -> None:
        if self.on_wait is not None:
            self.on_wait(model, seconds, outcome)


def _stop_waiting(q: _ModelQueue, waiter: _Waiter) -> None:
    waiting = q.waiting_of.get(waiter.member_hash)
    if waiting is not None:
        waiting.discard(waiter)
        if not waiting:
            del q.waiting_of[waiter.member_hash]


def _weight_of(value: float | tuple[int, float]) -> float:
    return value[1] if isinstance(value, tuple) else value


def _bound(given: int | None, queue: int | None, setting: Callable[[], int]) -> int:
    """A share's bound: the one given, else the queue's when that is given, else the setting."""
    return given if given is not None else queue if queue is not None else setting()


def _add(counts: dict[int, int], key: int, delta: int) -> None:
    left = counts.get(key, 0) + delta
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


class _Turn:
    """One request's place in the queue, from asking for a turn to the end of its answer."""

    def __init__(
        self,
        queue: FairQueue,
        *,
        model: str,
        who: Who,
        hashes: Hashes,
        weight: float,
        team_weight: float | None,
        user_weight: float | None,
        candidates: tuple[Candidate, ...],
        balancer: Balancer,
        hangup: Callable[[], Awaitable[Any]] | None,
        timeout: float,
        limit: int,
        per_key: int,
        per_user: int,
    ) -> None:
        self.queue = queue
        self.model, self.who, self.weight, self.team_weight = model, who, weight, team_weight
        self.user_weight = user_weight
        self.hashes = hashes
        self.candidates, self.balancer, self.hangup = candidates, balancer, hangup
        self.timeout, self.limit, self.per_key, self.per_user = timeout, limit, per_key, per_user
        self._waiter: _Waiter | None = None

    def share(self, members: Mapping[int, Any], keys: Mapping[int, Any]) -> float:
        """This request's member's share, given who is in use: the top's members and the
        member's keys (weights, or (entries, weight) as a process keeps them)."""
        flow_hash, member_hash, _ = self.hashes
        others = [_weight_of(v) for k, v in members.items() if k != member_hash]
        weights = [_weight_of(v) for k, v in keys.items() if k != flow_hash]
        return share(self.team_weight, self.user_weight, others, [*weights, self.weight])

    async def __aenter__(self) -> Granted:
        self._waiter, granted = await self.queue._enter(self)
        return granted

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._waiter is not None:
            self.queue._exit(self._waiter)
            self._waiter = None
