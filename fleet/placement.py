"""Where replicas go and what must stop: the reconciler's placement plan.

The reconciler calls :func:`plan_placement` once per pass with the nodes, the models and the
replicas that are running (or starting). It gets back a :class:`Plan`: replicas to start,
replicas to stop (scale down, removed models), replicas to preempt, and the replicas that fit
nowhere, each with a reason a person can act on. It is a pure function over plain frozen
dataclasses (no Django, no I/O), so it is cheap to test and can also answer "what if" questions
for ``llmgw ctl``. Its rules, in the order it applies them and numbered as the comments here
cite them: docs/nodes.md#how-placement-decides.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

#: Class ranks: a higher rank is served first and may preempt lower ranks.
CLASS_RANK: dict[str, int] = {"critical": 3, "standard": 2, "opportunistic": 1}

#: Tolerance when comparing quantities, so float sums do not break exact fits.
EPSILON = 1e-6

#: The most moves one pass plans (rule 6), one per model at most: each starts an engine.
MAX_MOVES = 8

# Internal resource vector: (memory_gb, cores, gpus, gpu_memory_gb). Tuples and lists of
# floats are used in the hot paths instead of Resources because they are much faster.
_Vec = tuple[float, float, float, float]
_DIMENSIONS = 4
_NOTHING: _Vec = (0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Resources:
    """An amount of node resources: a node's capacity, free room, or a reservation.

    ``gpu_memory_gb`` is the total GPU memory reserved (or available) across the GPUs: a
    replica of 2 GPUs reserving 10 GB on each has 20 here.
    """

    memory_gb: float = 0
    cores: float = 0
    gpus: int = 0
    gpu_memory_gb: float = 0


@dataclass(frozen=True)
class Device:
    """One GPU of a node: its total memory and the memory observed in use on it by every
    process (llmgw's engines included), in GB."""

    index: int
    total_gb: float
    used_gb: float = 0


@dataclass(frozen=True)
class Node:
    """A machine replicas run on. Cordoned or lost nodes are not ``schedulable``.

    ``devices``: its GPUs, when known; then GPU profiles are placed on them one by one (rule 7)
    and ``capacity.gpus`` / ``capacity.gpu_memory_gb`` are not used. ``gpu_engine``: whether
    its engine binary has a GPU backend (CUDA); a node without one takes no GPU profile.
    ``engines``: the engines it has (llmgw.engines' names); a model's replicas go only to nodes
    with its engine. None: every engine (a node the caller does not say of).
    """

    name: str
    capacity: Resources
    schedulable: bool = True
    devices: tuple[Device, ...] = ()
    gpu_engine: bool = True
    engines: frozenset[str] | None = None
    # Those of its engines that can use its GPUs; None: gpu_engine says for every engine.
    gpu_engines: frozenset[str] | None = None


@dataclass(frozen=True)
class Profile:
    """One way to run a model (e.g. "gpu", "cpu") and what a replica of it reserves.

    ``note`` explains the memory reservation when it is more than the profile declares (its
    engine's KV cache, fleet.footprint); refusals short of memory end with it.
    ``resources.gpu_memory_gb`` is over all its ``gpus``: each of its devices holds an even share.
    """

    name: str
    resources: Resources
    note: str = ""


@dataclass(frozen=True)
class ModelDemand:
    """What one catalog model wants this pass.

    ``desired`` is how many replicas it wants now (the caller has already applied min
    replicas and on-demand); ``minimum`` is its min replicas (0 for an on-demand model).
    A ``minimum`` above ``desired`` is treated as ``desired``. ``klass`` is a key of
    :data:`CLASS_RANK`. ``profiles`` are tried in order. ``moving``: the replica it lacks
    replaces one being moved (rule 6), which never preempts.
    """

    name: str
    klass: str
    minimum: int
    desired: int
    profiles: tuple[Profile, ...]
    moving: bool = False  # its replicas beyond its minimum only move (rule 6): no preemption
    engine: str = ""  # the engine its replicas run: only nodes that have it take them ("": any)


@dataclass(frozen=True)
class Replica:
    """A replica that is running or starting on a node, with what it reserves there.

    ``devices``: the indices of the node's GPUs it holds, its ``resources.gpu_memory_gb``
    split evenly over them. A GPU replica without them (placed before devices were known)
    is given the emptiest devices when the pass starts, for the pass's accounting only.

    ``leaving``: it serves only until a replacement is ready (out of date in an update, a
    rollback or a canary's end, or being moved): it holds its room, but the spread (rule 4)
    does not count it, so that its replacement may go to its node.
    """

    id: str
    model: str
    node: str
    profile: str
    resources: Resources
    devices: tuple[int, ...] = ()
    leaving: bool = False


@dataclass(frozen=True)
class Start:
    """Start one replica of ``model`` on ``node`` with ``profile``; ``devices`` are the
    indices of the GPUs chosen for it (in index order; none for a CPU profile or a node
    without a device list), each holding ``resources.gpu_memory_gb / len(devices)``."""

    model: str
    node: str
    profile: str
    resources: Resources
    devices: tuple[int, ...] = ()

    @property
    def gb_per_device(self) -> float:
        return self.resources.gpu_memory_gb / len(self.devices) if self.devices else 0.0


@dataclass(frozen=True)
class Stop:
    """Stop replica ``replica_id``; ``reason`` says why in words (for events and logs)."""

    replica_id: str
    model: str
    node: str
    reason: str


@dataclass(frozen=True)
class Move:
    """Move replica ``replica_id`` of ``model`` off ``node``, which holds more of the model
    than ``to``, a node without it that has room for one now (rule 6): a replacement starts
    first and this one stops once it is ready."""

    replica_id: str
    model: str
    node: str
    to: str
    here: int  # replicas of the model on ``node``


@dataclass(frozen=True)
class DeviceRoom:
    """One GPU's memory after the plan, against what one share of a profile needs, in GB:
    the figures behind a refusal of a GPU profile. ``others_gb`` is memory other programs
    hold (observed use beyond llmgw's reservations); ``free_gb`` = total - reserved - others."""

    node: str
    index: int
    total_gb: float
    reserved_gb: float
    others_gb: float
    free_gb: float
    needed_gb: float


@dataclass(frozen=True)
class Unplaced:
    """``count`` replicas of ``model`` fit nowhere, even with preemption; ``reason`` says why.

    ``devices``: for a GPU profile refused for lack of device memory, the devices of the node
    that came closest, with their figures (the reason says the same in words)."""

    model: str
    count: int
    reason: str
    devices: tuple[DeviceRoom, ...] = ()


@dataclass(frozen=True)
class Plan:
    """One pass's decisions. Apply ``stops`` and ``preemptions`` before ``starts``."""

    starts: tuple[Start, ...]
    stops: tuple[Stop, ...]
    preemptions: tuple[Stop, ...]
    unplaced: tuple[Unplaced, ...]
    moves: tuple[Move, ...] = ()


def plan_placement(
    nodes: Sequence[Node], models: Sequence[ModelDemand], replicas: Sequence[Replica]
) -> Plan:
    """Decide which replicas to start, stop and preempt this pass (its rules, in order:
    docs/nodes.md#how-placement-decides).

    The plan does not depend on the order of the inputs. Raises ``ValueError`` on
    duplicate node, model or replica names, an unknown class, negative counts or
    negative profile resources.
    """
    planner = _Planner(nodes, models)
    planner.adopt(replicas)
    planner.scale_down()
    for rank in sorted(set(CLASS_RANK.values()), reverse=True):
        planner.serve_class(rank)
    planner.spread_out()
    return planner.plan()


def fits(need: Resources, room: Resources) -> bool:
    """Whether a reservation fits in a node's capacity or free room: every resource it needs
    (a zero need never blocks), to within :data:`EPSILON`.

    The planner's own test. Why public: the gateway asks whether an on-demand model fits on any
    node at all before it wakes the model (fleet.selectors.unplaceable_models); a second copy
    there once compared without the tolerance, so a model the planner would place was refused
    as fitting nowhere.
    """
    return _fits(_vec(need), _vec(room))


def fits_on_empty(need: Resources, node: Node, engine: str = "") -> bool:
    """Whether ``need`` fits on ``node`` with nothing of llmgw on it: what the gateway asks of
    an on-demand model before it wakes it (fleet.selectors.unplaceable_models). A GPU need asks
    for a GPU engine and, on a node that lists its devices, ``need.gpus`` devices whose total
    memory holds an even share (rule 7); what other programs hold now is not counted, as it may
    be given back by the time the model is placed."""
    if need.gpus <= 0:
        return fits(need, node.capacity)
    if not gpus_for(node, engine):
        return False
    if not node.devices:
        return fits(need, node.capacity)
    share = need.gpu_memory_gb / need.gpus
    roomy = sum(1 for d in node.devices if share <= d.total_gb + EPSILON)
    host = Resources(need.memory_gb, need.cores)
    return roomy >= need.gpus and fits(host, node.capacity)


# --- internals -------------------------------------------------------------------------


def _vec(resources: Resources) -> _Vec:
    return (
        float(resources.memory_gb),
        float(resources.cores),
        float(resources.gpus),
        float(resources.gpu_memory_gb),
    )


def _fits(need: Sequence[float], room: Sequence[float]) -> bool:
    # A zero need always fits, even on a node that is over-committed on that resource.
    # Unrolled: this is the hottest function of the planner.
    return (
        (need[0] <= 0 or need[0] <= room[0] + EPSILON)
        and (need[1] <= 0 or need[1] <= room[1] + EPSILON)
        and (need[2] <= 0 or need[2] <= room[2] + EPSILON)
        and (need[3] <= 0 or need[3] <= room[3] + EPSILON)
    )


def _devices(node: Node) -> dict[int, _Device]:
    devices: dict[int, _Device] = {}
    for device in sorted(node.devices, key=lambda d: d.index):
        if device.index in devices:
            raise ValueError(f"node {node.name!r}: duplicate device {device.index}")
        if device.index < 0 or device.total_gb < 0 or device.used_gb < 0:
            raise ValueError(f"node {node.name!r}: device {device.index} is negative")
        devices[device.index] = _Device(device.index, float(device.total_gb), float(device.used_gb))
    return devices


def _charge(node: _NodeState, need: _Vec) -> _Vec:
    """What a replica takes from its node's free room: on a node that lists its devices, the
    GPU count is not used up (devices are shared by memory; the devices hold the rest)."""
    if node.devices and need[2]:
        return (need[0], need[1], 0.0, need[3])
    return need


def _gb(x: float) -> str:
    return f"{round(x, 2):g}"


def _bigness(slot: _Slot) -> tuple[float, float, float, float, str]:
    return slot.bigness


def _num(x: float) -> str:
    return f"{x:g}"


def _describe(vec: Sequence[float]) -> str:
    memory, cores, gpus, gpu_memory = vec
    parts = []
    if memory:
        parts.append(f"{_num(memory)} GB memory")
    if cores:
        parts.append(f"{_num(cores)} cores")
    if gpus:
        parts.append(f"{_num(gpus)} GPU" + ("" if gpus == 1 else "s"))
    if gpu_memory:
        parts.append(f"{_num(gpu_memory)} GB GPU memory")
    return ", ".join(parts) or "nothing"


@dataclass(slots=True, eq=False)
class _Slot:
    """A replica as the planner tracks it: running, or planned to start in this pass."""

    key: str  # replica id, or "start#N" for a planned start
    model: str
    node: str
    profile: str
    need: _Vec
    rank: int
    start: int | None = None  # key of the planned Start, if it is one
    devices: tuple[int, ...] = ()  # the node's GPUs it holds (on a node that lists them)
    leaving: bool = False  # serves until its replacement is ready; not in the spread
    # Victim order within a class: biggest reservation first (memory, then cores, GPUs,
    # GPU memory), then replica key for determinism.
    bigness: tuple[float, float, float, float, str] = field(init=False)
    share: float = field(init=False)  # GPU memory on each of its devices

    def __post_init__(self) -> None:
        memory, cores, gpus, gpu_memory = self.need
        self.bigness = (-memory, -cores, -gpus, -gpu_memory, self.key)
        self.share = gpu_memory / len(self.devices) if self.devices else 0.0


@dataclass(slots=True, eq=False)
class _Device:
    """A GPU as the planner tracks it (rule 7 in docs/nodes.md#how-placement-decides)."""

    index: int
    total: float
    used: float  # observed, every process's
    reserved: float = 0.0  # by llmgw replicas, running and planned
    others: float = 0.0  # held by other programs: set once the running replicas are adopted

    @property
    def free(self) -> float:
        return self.total - self.reserved - self.others


@dataclass(slots=True, eq=False)
class _VictimOrder:
    """A node's preemptible replicas in victim order, as of ``version`` of the node and the
    replica counts (``counts``) of the models on it."""

    version: int
    counts: tuple[int, ...] = ()
    slots: list[_Slot] = field(default_factory=list)
    beyond: int = 0  # how many of them are beyond their model's minimum
    biggest: list[float] = field(default_factory=lambda: [0.0] * _DIMENSIONS)  # per resource


@dataclass(slots=True, eq=False)
class _NodeState:
    name: str
    schedulable: bool
    free: list[float]
    # Replicas per class rank, biggest reservation first: the order victims are taken in.
    by_rank: dict[int, list[_Slot]] = field(default_factory=dict)
    # Reservations of the replicas of class rank <= r, per r: lets the preemption search
    # rule a node out in O(1) (preemptible classes are always the lowest ones).
    load_upto: dict[int, list[float]] = field(default_factory=dict)
    # Per class rank, reservations of replicas whose model has more than its minimum:
    # the most a same-class model below its minimum could preempt here.
    spare_load: dict[int, list[float]] = field(default_factory=dict)
    # Bumped whenever what the victim search sees on this node may have changed.
    version: int = 0
    # Its GPUs by index, when it lists them; GPU profiles then go to devices (rule 7).
    devices: dict[int, _Device] = field(default_factory=dict)
    gpu_engine: bool = True
    engines: frozenset[str] | None = None
    gpu_engines: frozenset[str] | None = None


class _FreeIndex:
    """Schedulable nodes sorted by (free memory, free cores, name), bucketed by free GPUs.

    Why: best fit is "least free memory left, then fewest free cores, then name", which
    for a given need is the same order as (free memory, free cores, name). So the first
    node at or above the needed memory that fits the rest is the best fit, found with a
    bisect instead of a scan over every node. Buckets by free GPUs let a GPU replica
    skip nodes without enough GPUs without looking at them.
    """

    def __init__(self) -> None:
        self._buckets: dict[int, list[tuple[float, float, str]]] = {}
        self._where: dict[str, tuple[int, tuple[float, float, str]]] = {}
        self._pending: dict[str, _NodeState] | None = None  # see deferred()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Updates made meanwhile are applied at the end, each node's once, with one sort a
        bucket: the planner's first steps (its nodes, then every running replica) update the
        index tens of thousands of times before anything is looked up in it, and each update
        of a sorted list of thousands moves half of it (a pass over 20,000 replicas on 5,000
        nodes spent a third of its planning there). Nothing may look a node up meanwhile."""
        self._pending = {}
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            for name, node in pending.items():
                self._where.pop(name, None)
                if node.schedulable:
                    entry = (node.free[0], node.free[1], node.name)
                    self._where[name] = (max(0, int(node.free[2] + EPSILON)), entry)
            buckets: dict[int, list[tuple[float, float, str]]] = {}
            for gpus, entry in self._where.values():
                buckets.setdefault(gpus, []).append(entry)
            for bucket in buckets.values():
                bucket.sort()
            self._buckets = buckets

    def update(self, node: _NodeState) -> None:
        if self._pending is not None:
            self._pending[node.name] = node
            return
        old = self._where.pop(node.name, None)
        if old is not None:
            bucket = self._buckets[old[0]]
            del bucket[bisect.bisect_left(bucket, old[1])]
        if node.schedulable:
            gpus = max(0, int(node.free[2] + EPSILON))
            entry = (node.free[0], node.free[1], node.name)
            bisect.insort(self._buckets.setdefault(gpus, []), entry)
            self._where[node.name] = (gpus, entry)

    def best_fit(
        self,
        need: _Vec,
        nodes: dict[str, _NodeState],
        avoid: dict[str, int],
        placeable: Callable[[_NodeState], bool] | None = None,
    ) -> str | None:
        """The best-fit schedulable node for ``need`` among nodes not in ``avoid`` (and, when
        given, where ``placeable`` says the GPUs can take it)."""
        assert self._pending is None, "the index is looked up while its updates are deferred"
        memory, cores, gpus, gpu_memory = need
        best: tuple[float, float, str] | None = None
        for bucket_gpus, bucket in self._buckets.items():
            if gpus > 0 and bucket_gpus + EPSILON < gpus:
                continue
            first = bisect.bisect_left(bucket, (memory - EPSILON,)) if memory > 0 else 0
            for i in range(first, len(bucket)):
                entry = bucket[i]
                if best is not None and entry >= best:
                    break  # everything further in this bucket is a worse fit
                name = entry[2]
                if name in avoid:
                    continue
                if cores > 0 and entry[1] + EPSILON < cores:
                    continue
                if gpu_memory > 0 and nodes[name].free[3] + EPSILON < gpu_memory:
                    continue
                if placeable is not None and not placeable(nodes[name]):
                    continue
                best = entry
                break
        return None if best is None else best[2]


class _Planner:
    """The mutable working state of one planning pass."""

    def __init__(self, nodes: Sequence[Node], models: Sequence[ModelDemand]) -> None:
        self.nodes: dict[str, _NodeState] = {}
        self.index = _FreeIndex()
        with self.index.deferred():
            self._add_nodes(nodes)

        self.models: dict[str, ModelDemand] = {}
        self.rank: dict[str, int] = {}
        self.minimum: dict[str, int] = {}
        for model in sorted(models, key=lambda m: m.name):
            _validate(model, self.models)
            self.models[model.name] = model
            self.rank[model.name] = CLASS_RANK[model.klass]
            self.minimum[model.name] = min(model.minimum, model.desired)

        self.count: dict[str, int] = dict.fromkeys(self.models, 0)
        # model -> node -> replicas of that model on that node (only non-zero counts).
        self.spread: dict[str, dict[str, int]] = {name: {} for name in self.models}
        self.model_slots: dict[str, dict[str, _Slot]] = {name: {} for name in self.models}

        self.starts: dict[int, Start] = {}  # insertion-ordered; cancelled starts removed
        self.next_start = 0
        self.stops: list[Stop] = []
        self.preemptions: list[Stop] = []
        self.moves: list[Move] = []
        # (node, tier, rank) -> preemptible replicas in victim order.
        self.order_cache: dict[tuple[str, int, int], _VictimOrder] = {}

    def _add_nodes(self, nodes: Sequence[Node]) -> None:
        for node in sorted(nodes, key=lambda n: n.name):
            if node.name in self.nodes:
                raise ValueError(f"duplicate node {node.name!r}")
            devices = _devices(node)
            free = list(_vec(node.capacity))
            if devices:
                # The devices replace the declared figures: the GPU count is what a replica
                # may span (devices are shared by memory, so it is never used up), and the
                # GPU memory pool is their sum (less other programs' share, once adopted).
                free[2] = float(len(devices))
                free[3] = sum(d.total for d in devices.values())
            state = _NodeState(
                name=node.name,
                schedulable=node.schedulable,
                free=free,
                by_rank={rank: [] for rank in CLASS_RANK.values()},
                load_upto={rank: [0.0] * _DIMENSIONS for rank in CLASS_RANK.values()},
                spare_load={rank: [0.0] * _DIMENSIONS for rank in CLASS_RANK.values()},
                devices=devices,
                gpu_engine=node.gpu_engine,
                engines=node.engines,
                gpu_engines=node.gpu_engines,
            )
            self.nodes[node.name] = state
            self.index.update(state)

    # -- bookkeeping --------------------------------------------------------------------

    def add(self, slot: _Slot) -> None:
        had_spare = self.count[slot.model] > self.minimum[slot.model]
        node = self.nodes[slot.node]
        bisect.insort(node.by_rank[slot.rank], slot, key=_bigness)
        for d in range(_DIMENSIONS):
            node.free[d] -= slot.need[d]
        for index in slot.devices:
            node.devices[index].reserved += slot.share
        for rank, load in node.load_upto.items():
            if rank >= slot.rank:
                for d in range(_DIMENSIONS):
                    load[d] += slot.need[d]
        if not slot.leaving:
            spread = self.spread[slot.model]
            spread[slot.node] = spread.get(slot.node, 0) + 1
        self.count[slot.model] += 1
        self.model_slots[slot.model][slot.key] = slot
        if had_spare:
            self.count_as_spare(slot, 1)
        elif self.count[slot.model] > self.minimum[slot.model]:
            for each in self.model_slots[slot.model].values():
                self.count_as_spare(each, 1)
        self.index.update(node)
        self.touch(slot)

    def remove(self, slot: _Slot) -> None:
        if self.count[slot.model] - 1 > self.minimum[slot.model]:
            self.count_as_spare(slot, -1)
        elif self.count[slot.model] > self.minimum[slot.model]:
            for each in self.model_slots[slot.model].values():
                self.count_as_spare(each, -1)
        node = self.nodes[slot.node]
        same_rank = node.by_rank[slot.rank]
        del same_rank[bisect.bisect_left(same_rank, slot.bigness, key=_bigness)]
        for d in range(_DIMENSIONS):
            node.free[d] += slot.need[d]
        for index in slot.devices:
            node.devices[index].reserved -= slot.share
        for rank, load in node.load_upto.items():
            if rank >= slot.rank:
                for d in range(_DIMENSIONS):
                    load[d] -= slot.need[d]
        if not slot.leaving:
            spread = self.spread[slot.model]
            spread[slot.node] -= 1
            if not spread[slot.node]:
                del spread[slot.node]
        self.count[slot.model] -= 1
        del self.model_slots[slot.model][slot.key]
        self.index.update(node)
        self.touch(slot)

    def count_as_spare(self, slot: _Slot, sign: int) -> None:
        """Add (or take back) ``slot`` in its node's load of models above their minimum."""
        load = self.nodes[slot.node].spare_load[slot.rank]
        for d in range(_DIMENSIONS):
            load[d] += sign * slot.need[d]

    def touch(self, slot: _Slot) -> None:
        """Invalidate cached victim searches of the node this replica came to or left.

        Its model's count changed too, which decides which of the model's replicas count as
        beyond its minimum on every node that hosts it: a cached search holds the counts of its
        node's models and is made again when they differ (`_model_counts`), rather than every
        such node being touched here (a model of 1,000 replicas would touch 1,000 nodes at each
        of its starts)."""
        self.nodes[slot.node].version += 1

    def _model_counts(self, node: _NodeState, tier: int) -> tuple[int, ...]:
        """The replica counts of the models a victim search of ``node`` up to ``tier`` sees, in
        the order it sees them (fixed for a version of the node)."""
        return tuple(
            self.count[slot.model]
            for rank in sorted(node.by_rank)
            if rank <= tier
            for slot in node.by_rank[rank]
        )

    def start(self, model: ModelDemand, profile: Profile, need: _Vec, node: str) -> None:
        state = self.nodes[node]
        devices = self.devices_for(state, need)
        assert devices is not None, "a start is planned only where its devices fit"
        key = self.next_start
        self.next_start += 1
        self.starts[key] = Start(model.name, node, profile.name, profile.resources, devices)
        rank = self.rank[model.name]
        charge = _charge(state, need)
        self.add(_Slot(f"start#{key}", model.name, node, profile.name, charge, rank, key, devices))

    # -- devices (rule 7) ---------------------------------------------------------------

    def devices_for(
        self, node: _NodeState, need: _Vec, given_back: dict[int, float] | None = None
    ) -> tuple[int, ...] | None:
        """The devices ``need`` would get on ``node`` (in index order), or None when it cannot
        go there. () for a CPU need, and on a node without a device list (the aggregate rule).

        ``given_back``: GPU memory per device that victims would free (preemption).
        """
        if need[2] <= 0:
            return ()
        if not node.gpu_engine:
            return None
        if not node.devices:
            return ()
        count = int(need[2] + EPSILON)
        if count > len(node.devices):
            return None
        share = need[3] / count
        room = []
        for device in node.devices.values():
            free = device.free + (given_back.get(device.index, 0.0) if given_back else 0.0)
            if share <= 0 or share <= free + EPSILON:
                room.append((-free, device.index))
        if len(room) < count:
            return None
        room.sort()  # the emptiest first, then the lowest index
        return tuple(sorted(index for _, index in room[:count]))

    def placeable(self, need: _Vec, engine: str = "") -> Callable[[_NodeState], bool] | None:
        """The test a node must pass for ``need`` of a model of ``engine``, beyond its free
        room: it has the engine, and its devices can take a GPU need (None: nothing to test)."""
        if need[2] <= 0:
            if not engine:
                return None
            return lambda node: has_engine(node, engine)
        return lambda node: (
            has_engine(node, engine)
            and gpus_for(node, engine)
            and self.devices_for(node, need) is not None
        )

    def settle_devices(self) -> None:
        """Once the running replicas are adopted: what other programs hold on each device is
        what is observed in use beyond llmgw's reservations, for the rest of the pass."""
        for node in self.nodes.values():
            if not node.devices:
                continue
            for device in node.devices.values():
                device.others = max(0.0, device.used - device.reserved)
                node.free[3] -= device.others
            self.index.update(node)

    # -- steps --------------------------------------------------------------------------

    def adopt(self, replicas: Sequence[Replica]) -> None:
        """Account for the running replicas; stop those of removed models or unknown nodes."""
        with self.index.deferred():
            self._adopt(replicas)
        self.settle_devices()

    def _adopt(self, replicas: Sequence[Replica]) -> None:
        seen: set[str] = set()
        for replica in sorted(replicas, key=lambda r: r.id):
            if replica.id in seen:
                raise ValueError(f"duplicate replica {replica.id!r}")
            seen.add(replica.id)
            if replica.model not in self.models:
                self.stops.append(
                    Stop(replica.id, replica.model, replica.node, "model removed from the catalog")
                )
            elif replica.node not in self.nodes:
                reason = f"node {replica.node} is not in the fleet"
                self.stops.append(Stop(replica.id, replica.model, replica.node, reason))
            else:
                rank = self.rank[replica.model]
                node = self.nodes[replica.node]
                need = _vec(replica.resources)
                devices = self.held_devices(node, replica, need)
                slot = _Slot(
                    replica.id,
                    replica.model,
                    replica.node,
                    replica.profile,
                    _charge(node, need),
                    rank,
                    devices=devices,
                    leaving=replica.leaving,
                )
                self.add(slot)

    def held_devices(self, node: _NodeState, replica: Replica, need: _Vec) -> tuple[int, ...]:
        """The devices a running replica is accounted on: those it was placed on that the node
        still lists, or, for a GPU replica without them, the emptiest ones (bookkeeping only:
        it is not moved)."""
        if need[2] <= 0 or not node.devices:
            return ()
        known = tuple(sorted({i for i in replica.devices if i in node.devices}))
        if known:
            return known
        count = min(int(need[2] + EPSILON), len(node.devices))
        emptiest = sorted(node.devices.values(), key=lambda d: (-d.free, d.index))
        return tuple(sorted(d.index for d in emptiest[:count]))

    def scale_down(self) -> None:
        """Stop replicas beyond ``desired`` (rule 2 in docs/nodes.md#how-placement-decides
        picks which)."""
        for name, model in self.models.items():
            while self.count[name] > model.desired:
                victim = min(self.model_slots[name].values(), key=self._scale_down_order)
                self.remove(victim)
                reason = f"scaled down to {model.desired}"
                self.stops.append(Stop(victim.key, victim.model, victim.node, reason))

    def _scale_down_order(self, slot: _Slot) -> tuple[bool, bool, int, float, float, str, str]:
        node = self.nodes[slot.node]
        return (
            node.schedulable,  # cordoned nodes drain first: they take nothing new anyway
            not slot.leaving,  # then those on their way out
            -self.spread[slot.model].get(slot.node, 0),  # keep the model spread over nodes
            node.free[0],  # then relieve the fullest node
            node.free[1],
            node.name,
            slot.key,
        )

    def serve_class(self, rank: int) -> None:
        """Serve one class: minimum replicas first, then replicas above minimum.

        Why the loop: replicas above minimum started in this pass raise their model's
        spare count, which can make more same-class replicas preemptible by a model still
        below its minimum. Retrying those models until nothing changes makes the plan
        stable: planning again after applying it changes nothing. It terminates because
        every retry round places at least one minimum replica, and no minimum replica is
        ever taken away within a class.
        """
        models = [m for m in self.models.values() if self.rank[m.name] == rank]
        self.serve_phase(models, rank, within_minimum=True)
        while self.serve_phase(models, rank, within_minimum=False):
            if not any(self.count[m.name] < self.minimum[m.name] for m in models):
                break
            if not self.serve_phase(models, rank, within_minimum=True):
                break

    def serve_phase(self, models: list[ModelDemand], rank: int, within_minimum: bool) -> int:
        """Place missing replicas (up to minimum, or up to desired); return how many."""
        # Needs that failed even with preemption in this phase. Free room plus what may
        # be preempted only shrinks within a phase, so a failed need stays failed.
        failed: set[_Vec] = set()
        candidates = self.preemption_candidates(rank, within_minimum)
        placed = 0
        for model in models:
            minimum = self.minimum[model.name]
            if within_minimum:
                target = minimum
            elif self.count[model.name] < minimum:
                continue  # it could not reach its minimum; growth above it would fail too
            else:
                target = model.desired
            while self.count[model.name] < target:
                if not self.place_one(model, rank, within_minimum, failed, candidates):
                    break  # nothing changed, so its next replica would fail the same way
                placed += 1
        return placed

    def place_one(
        self,
        model: ModelDemand,
        rank: int,
        within_minimum: bool,
        failed: set[_Vec],
        candidates: list[tuple[float, str]],
    ) -> bool:
        # Every profile without preemption first: disturbing nothing beats a better profile.
        for profile in model.profiles:
            need = _vec(profile.resources)
            node = self.best_free_node(model.name, need)
            if node is not None:
                self.start(model, profile, need, node)
                return True
        if not candidates or (model.moving and not within_minimum):
            return False
        for profile in model.profiles:
            need = _vec(profile.resources)
            if need in failed:
                continue
            choice = self.cheapest_preemption(model.name, rank, within_minimum, need, candidates)
            if choice is None:
                failed.add(need)
                continue
            node, victims = choice
            for victim in victims:
                self.preempt(victim, model, need, node)
            self.start(model, profile, need, node)
            return True
        return False

    def best_free_node(self, model: str, need: _Vec) -> str | None:
        """Spread first, then best fit, among nodes where ``need`` fits in free room."""
        spread = self.spread[model]
        placeable = self.placeable(need, self.models[model].engine)
        # A node without this model always wins the spread, so look there first.
        node = self.index.best_fit(need, self.nodes, spread, placeable)
        if node is not None:
            return node
        best: tuple[int, float, float, str] | None = None
        for name, replicas in spread.items():
            state = self.nodes[name]
            if (
                state.schedulable
                and _fits(need, state.free)
                and (placeable is None or placeable(state))
            ):
                key = (replicas, state.free[0], state.free[1], name)
                if best is None or key < best:
                    best = key
        return None if best is None else best[3]

    def spread_out(self) -> None:
        """Rule 6: a model this pass left alone, with two or more replicas on one node while a
        node without it has free room for one, moves one replica there (at most one per model
        and :data:`MAX_MOVES` a pass). Only free room counts: a move never preempts."""
        changed = {start.model for start in self.starts.values()}
        changed.update(stop.model for stop in self.stops)
        changed.update(stop.model for stop in self.preemptions)
        for name, model in self.models.items():
            if len(self.moves) >= MAX_MOVES:
                return
            spread = self.spread[name]
            if name in changed or self.count[name] != model.desired or not spread:
                continue
            most = max(spread.values())
            slots = self.model_slots[name].values()
            if most < 2 or any(slot.leaving for slot in slots):
                continue  # spread already, or a replacement under way settles it
            crowded = min(
                (n for n, here in spread.items() if here == most),
                key=lambda n: (self.nodes[n].free[0], self.nodes[n].free[1], n),
            )
            replica = min((s for s in slots if s.node == crowded), key=lambda s: s.key)
            profile = next((p for p in model.profiles if p.name == replica.profile), None)
            if profile is None:
                continue  # its profile is gone: it is out of date and will be replaced anyway
            need = _vec(profile.resources)
            to = self.index.best_fit(need, self.nodes, spread, self.placeable(need, model.engine))
            if to is not None:
                self.moves.append(Move(replica.key, name, crowded, to, most))

    # -- preemption ---------------------------------------------------------------------

    @staticmethod
    def preemptible_ranks(rank: int, within_minimum: bool) -> list[int]:
        # Same class only for a replica bringing its model up to its minimum.
        return sorted(r for r in CLASS_RANK.values() if r < rank or (r == rank and within_minimum))

    def preemptible_room(self, node: _NodeState, rank: int, tier: int) -> list[float]:
        """Free room plus everything a model of class ``rank`` may preempt up to ``tier``.

        An upper bound: it rules a node out in O(1) before the exact victim search.
        """
        free = node.free
        if tier < rank:
            load = node.load_upto[tier]
            return [free[0] + load[0], free[1] + load[1], free[2] + load[2], free[3] + load[3]]
        # Same class: only models above their minimum give anything up. (Ranks are
        # consecutive, so rank - 1 is the next class down; the lowest has none below.)
        spare = node.spare_load[rank]
        lower = node.load_upto.get(rank - 1, _NOTHING)
        return [free[d] + lower[d] + spare[d] for d in range(_DIMENSIONS)]

    def preemption_candidates(self, rank: int, within_minimum: bool) -> list[tuple[float, str]]:
        """Schedulable nodes, most memory free-or-preemptible first, for this phase.

        That memory bound can only shrink during a phase (what gets placed is not
        preemptible by the rest of the phase), so a search stops at the first node whose
        bound is below the need.
        """
        ranks = self.preemptible_ranks(rank, within_minimum)
        if not ranks:
            return []
        candidates = [
            (-self.preemptible_room(node, rank, ranks[-1])[0], node.name)
            for node in self.nodes.values()
            if node.schedulable
        ]
        candidates.sort()
        return [(-neg_bound, name) for neg_bound, name in candidates]

    def cheapest_preemption(
        self,
        model: str,
        rank: int,
        within_minimum: bool,
        need: _Vec,
        candidates: list[tuple[float, str]],
    ) -> tuple[str, list[_Slot]] | None:
        """The node and victims that make room for ``need`` most cheaply, if any.

        Cost, cheapest first: lowest highest victim class, fewest victims, fewest victims
        within their model's minimum, fewest replicas of this model on the node (spread),
        most memory free or preemptible on the node, node name.

        Tiers: try victims of the lowest class only, then up to the next class, and stop
        at the first tier where some node works, so every set found in a tier has the
        same highest class. Within a tier nodes are visited in the last tie-break's order,
        so the search stops at the first node that no other node can beat.
        """
        spread = self.spread[model]
        engine = self.models[model].engine
        for tier in self.preemptible_ranks(rank, within_minimum):
            roomy = []
            nodes = self.nodes
            room_of = self.preemptible_room
            for bound, name in candidates:
                if need[0] > 0 and bound + EPSILON < need[0]:
                    break
                room = room_of(nodes[name], rank, tier)
                if (
                    _fits(need, room)
                    and (need[2] <= 0 or gpus_for(nodes[name], engine))
                    and has_engine(nodes[name], engine)
                ):
                    roomy.append((-room[0], name))
            roomy.sort()
            best_key: tuple[int, int, int] | None = None
            best: tuple[str, list[_Slot]] | None = None
            for _, name in roomy:
                node = nodes[name]
                here = spread.get(name, 0)
                if best_key is not None and self.cannot_beat(
                    node, rank, tier, need, here, best_key
                ):
                    continue
                victims = self.victims_on(node, rank, tier, need)
                if victims is None:
                    continue
                many, minimum_ones = self.victim_cost(victims)
                key = (many, minimum_ones, here)
                if best_key is None or key < best_key:
                    best_key, best = key, (name, victims)
                    if key <= (1, 0, 0):
                        break  # the least any preemption can cost
            if best is not None:
                return best
        return None

    def cannot_beat(
        self,
        node: _NodeState,
        rank: int,
        tier: int,
        need: _Vec,
        here: int,
        best_key: tuple[int, int, int],
    ) -> bool:
        """Whether ``node``'s victims surely cost at least ``best_key`` (a tie loses).

        A quick lower bound: one victim is only possible if the biggest preemptible
        amount of each resource would fit, and no victim beyond its model's minimum means
        every victim is within one.
        """
        order = self.victim_order(node, rank, tier)
        biggest, free = order.biggest, node.free
        one_will_do = _fits(need, [free[d] + biggest[d] for d in range(_DIMENSIONS)])
        fewest = 1 if one_will_do else 2
        return (fewest, 0 if order.beyond else fewest, here) >= best_key

    def victims_on(self, node: _NodeState, rank: int, tier: int, need: _Vec) -> list[_Slot] | None:
        """The victims (of class ``tier`` or lower) to stop on ``node`` to fit ``need``.

        Taken greedily in victim order until the need fits, then any victim that turned
        out unnecessary is given back, so no replica is stopped for nothing. For a GPU need
        on a node that lists its devices, "fits" also means that the devices can take it
        once the victims' shares are given back (rule 7).
        """
        by_device = need[2] > 0 and bool(node.devices)

        def fits_without(room: Sequence[float], victims: Sequence[_Slot]) -> bool:
            if not _fits(need, room):
                return False
            if not by_device:
                return True
            given_back: dict[int, float] = {}
            for victim in victims:
                for index in victim.devices:
                    given_back[index] = given_back.get(index, 0.0) + victim.share
            return self.devices_for(node, need, given_back) is not None

        room = list(node.free)
        victims: list[_Slot] = []
        if not fits_without(room, victims):
            for slot in self.victim_order(node, rank, tier).slots:
                victims.append(slot)
                for d in range(_DIMENSIONS):
                    room[d] += slot.need[d]
                if fits_without(room, victims):
                    break
            else:
                return None
        kept: list[_Slot] = []
        remaining = list(victims)
        for slot in reversed(victims):  # latest picked (least wanted) first
            without = [room[0] - slot.need[0], room[1] - slot.need[1]]
            without += [room[2] - slot.need[2], room[3] - slot.need[3]]
            others = [v for v in remaining if v is not slot]
            if fits_without(without, others):
                room = without
                remaining = others
            else:
                kept.append(slot)
        kept.reverse()
        return kept

    def victim_order(self, node: _NodeState, rank: int, tier: int) -> _VictimOrder:
        """Preemptible replicas on ``node`` in the order they are taken.

        Lowest class first; within a class, replicas beyond their model's minimum before
        minimum ones; then biggest reservation first. Which of a model's replicas count as
        "beyond its minimum" is decided biggest first. Remembered until the node changes:
        it does not depend on the need, and profile shapes vary a lot.

        The preempting model's own replicas never show up here: they are of its class,
        and are only preemptible while it is below its minimum, when it has none spare.
        """
        key = (node.name, tier, rank)
        hit = self.order_cache.get(key)
        counts = self._model_counts(node, tier)
        if hit is not None and hit.version == node.version and hit.counts == counts:
            return hit
        order = _VictimOrder(node.version, counts)
        spare: dict[str, int] = {}
        for victim_rank in sorted(node.by_rank):
            if victim_rank > tier:
                break
            minimum_ones = []
            for slot in node.by_rank[victim_rank]:
                left = spare.get(slot.model)
                if left is None:
                    left = self.count[slot.model] - self.minimum[slot.model]
                if left > 0:
                    spare[slot.model] = left - 1
                    order.slots.append(slot)
                    order.beyond += 1
                else:
                    spare[slot.model] = left
                    # Never another same-class model's minimum replicas.
                    if victim_rank < rank:
                        minimum_ones.append(slot)
            order.slots.extend(minimum_ones)
        for slot in order.slots:
            order.biggest = [max(a, b) for a, b in zip(order.biggest, slot.need, strict=True)]
        self.order_cache[key] = order
        return order

    def victim_cost(self, victims: list[_Slot]) -> tuple[int, int]:
        """How many victims, and how many of them are within their model's minimum."""
        taken: dict[str, int] = {}
        for slot in victims:
            taken[slot.model] = taken.get(slot.model, 0) + 1
        within_their_minimum = sum(
            max(0, n - max(0, self.count[m] - self.minimum[m])) for m, n in taken.items()
        )
        return len(victims), within_their_minimum

    def preempt(self, victim: _Slot, model: ModelDemand, need: _Vec, node: str) -> None:
        self.remove(victim)
        if victim.start is not None:
            # A replica planned in this pass (same class, above its minimum): just do not
            # start it. Its model is retried afterwards.
            del self.starts[victim.start]
            return
        reason = (
            f"preempted for {model.klass} model {model.name} (needs {_describe(need)} on {node})"
        )
        self.preemptions.append(Stop(victim.key, victim.model, victim.node, reason))

    # -- result -------------------------------------------------------------------------

    def plan(self) -> Plan:
        explain = _Explainer(self.nodes, self)
        unplaced = [
            Unplaced(model.name, model.desired - self.count[name], *explain.why(model))
            for name, model in sorted(self.models.items(), key=lambda kv: -self.rank[kv[0]])
            if self.count[name] < model.desired
        ]
        return Plan(
            starts=tuple(self.starts.values()),
            stops=tuple(self.stops),
            preemptions=tuple(self.preemptions),
            unplaced=tuple(unplaced),
            moves=tuple(self.moves),
        )


def has_engine(node: _NodeState | Node, engine: str) -> bool:
    """Whether a node has the engine a model runs ("" or a node that does not say: yes)."""
    return not engine or node.engines is None or engine in node.engines


def gpus_for(node: _NodeState | Node, engine: str) -> bool:
    """Whether the node's engine of a model (any, for "") can put it on the node's GPUs."""
    if not node.gpu_engine:
        return False
    return not engine or node.gpu_engines is None or engine in node.gpu_engines


def _validate(model: ModelDemand, known: dict[str, ModelDemand]) -> None:
    if model.name in known:
        raise ValueError(f"duplicate model {model.name!r}")
    if model.klass not in CLASS_RANK:
        raise ValueError(f"model {model.name!r}: unknown class {model.klass!r}")
    if model.minimum < 0 or model.desired < 0:
        raise ValueError(f"model {model.name!r}: negative minimum or desired")
    for profile in model.profiles:
        if any(x < 0 for x in _vec(profile.resources)):
            raise ValueError(f"model {model.name!r}: profile {profile.name!r} is negative")


class _Explainer:
    """Words for why a model's replicas fit nowhere, from the free room after the plan."""

    _SHORT = (
        "no node has {need} GB memory free for profile {profile}; "
        "the largest free is {best} GB on {node}",
        "no node has {need} cores free for profile {profile}; the most free is {best} on {node}",
        "needs {need} GPUs for profile {profile}; the most free on any node is {best} ({node})",
        "no node has {need} GB GPU memory free for profile {profile}; "
        "the largest free is {best} GB on {node}",
    )
    _NAMES = ("memory", "cores", "GPUs", "GPU memory")

    def __init__(self, nodes: dict[str, _NodeState], planner: _Planner) -> None:
        self.nodes = [node for node in nodes.values() if node.schedulable]  # sorted by name
        self.gpu_nodes = [node for node in self.nodes if node.gpu_engine]
        self.planner = planner
        self._most: dict[bool, list[tuple[float, str]]] = {}
        self._said: dict[tuple[str, _Vec, str], tuple[str, tuple[DeviceRoom, ...]]] = {}

    def most(self, gpu: bool) -> list[tuple[float, str]]:
        """The most free per resource and where, among the nodes a need may go to (those with a
        GPU engine for a GPU need): the first node by name wins a tie."""
        found = self._most.get(gpu)
        if found is None:
            nodes = self.gpu_nodes if gpu else self.nodes
            found = []
            for d in range(_DIMENSIONS):
                best = max(nodes, key=lambda n: n.free[d], default=None)
                found.append((best.free[d], best.name) if best else (0.0, ""))
            self._most[gpu] = found
        return found

    def why(self, model: ModelDemand) -> tuple[str, tuple[DeviceRoom, ...]]:
        if not model.profiles:
            return "the model has no profiles", ()
        if not self.nodes:
            return "no schedulable nodes", ()
        if not any(has_engine(node, model.engine) for node in self.nodes):
            return self._no_engine(model.engine), ()
        profile = model.profiles[0]
        if (
            profile.resources.gpus > 0
            and self.gpu_nodes
            and not any(gpus_for(node, model.engine) for node in self.nodes)
        ):
            return self._no_gpus_for(model.engine, profile.name), ()
        need = _vec(profile.resources)
        # Many models share a profile shape; the words only depend on it.
        said = self._said.get((profile.name, need, profile.note))
        if said is None:
            words, devices = self._words(profile.name, need)
            if profile.note and "memory" in words:
                words += f" ({profile.note})"
            said = self._said[profile.name, need, profile.note] = (words, devices)
        return said

    def _words(self, profile: str, need: _Vec) -> tuple[str, tuple[DeviceRoom, ...]]:
        gpu = need[2] > 0
        nodes = self.gpu_nodes if gpu else self.nodes
        if not nodes:
            return self._no_gpu_engine(profile, need), ()
        most = self.most(gpu)
        by_device = [n for n in nodes if n.devices] if gpu else []
        # Nodes that list their devices are explained device by device below, not by the pool.
        dims = range(3) if by_device else range(_DIMENSIONS)
        short = [
            self._SHORT[d].format(
                need=_num(need[d]),
                profile=profile,
                best=_num(most[d][0]),
                node=most[d][1],
            )
            for d in dims
            if need[d] > 0 and most[d][0] + EPSILON < need[d]
        ]
        if short:
            return "; ".join(short), ()
        if by_device and not any(self._placeable(n, need) for n in nodes):
            return self._short_of_devices(profile, need, by_device)
        return self._closest(profile, need, nodes), ()

    def _placeable(self, node: _NodeState, need: _Vec) -> bool:
        return _fits(need, node.free) and self.planner.devices_for(node, need) is not None

    def _no_engine(self, engine: str) -> str:
        names = ", ".join(n.name for n in self.nodes[:3]) + (", ..." if len(self.nodes) > 3 else "")
        return (
            f"no schedulable node has the engine {engine}: its nodes ({names}) report others. "
            f"Install it on a node (docs/engines.md) and restart that node's agent"
        )

    def _no_gpus_for(self, engine: str, profile: str) -> str:
        return (
            f"no node's {engine} can use its GPUs: profile {profile} needs GPUs, and {engine} "
            "is installed without a GPU backend on every node that has one (docs/engines.md)"
        )

    def _no_gpu_engine(self, profile: str, need: _Vec) -> str:
        names = ", ".join(n.name for n in self.nodes[:3]) + (", ..." if len(self.nodes) > 3 else "")
        gpus = int(need[2] + EPSILON)
        return (
            "no node has a GPU engine (an engine built with CUDA): profile "
            f"{profile} needs {gpus} GPU{'' if gpus == 1 else 's'}, and the engine of every "
            f"schedulable node ({names}) has only its CPU backend. On a machine with NVIDIA "
            "GPUs, build the engine with `LLMGW_ENGINE=cuda make setup` (docs/nodes.md, "
            "GPU nodes) and restart its node agent; or give the model a CPU profile"
        )

    def _short_of_devices(
        self, profile: str, need: _Vec, nodes: list[_NodeState]
    ) -> tuple[str, tuple[DeviceRoom, ...]]:
        """No node's devices can take the need: name the closest, with each device's figures."""
        count = int(need[2] + EPSILON)
        share = need[3] / count

        def closeness(node: _NodeState) -> tuple[int, float]:
            frees = sorted((d.free for d in node.devices.values()), reverse=True)
            with_room = sum(1 for free in frees if share <= free + EPSILON)
            kth = frees[count - 1] if len(frees) >= count else float("-inf")
            return (min(with_room, count), kth)

        node = max(nodes, key=closeness)  # the first by name wins a tie
        rooms = tuple(
            DeviceRoom(
                node=node.name,
                index=d.index,
                total_gb=d.total,
                reserved_gb=d.reserved,
                others_gb=d.others,
                free_gb=d.free,
                needed_gb=share,
            )
            for d in node.devices.values()
        )
        each = " each" if count > 1 else ""
        figures = "; ".join(
            f"GPU {r.index}: {_gb(r.total_gb)} GB, {_gb(r.reserved_gb)} GB reserved by llmgw, "
            f"{_gb(r.others_gb)} GB used by other programs, {_gb(r.free_gb)} GB free"
            for r in rooms
        )
        words = (
            f"no node has {count} GPU{'' if count == 1 else 's'} with {_gb(share)} GB of GPU "
            f"memory free{each} for profile {profile}; the closest is {node.name} ({figures})"
        )
        return words, rooms

    def _closest(self, profile: str, need: _Vec, nodes: list[_NodeState]) -> str:
        # Each resource is free somewhere, just not all on one node: name the node that
        # is short on the fewest resources and what it lacks.
        def lacks(node: _NodeState) -> list[int]:
            return [
                d for d in range(_DIMENSIONS) if need[d] > 0 and node.free[d] + EPSILON < need[d]
            ]

        node = min(nodes, key=lambda n: len(lacks(n)))
        missing = lacks(node)
        if not missing:
            # Free room fits, so what stood in the way were replicas it may not preempt.
            return f"profile {profile} fits on {node.name} only by preempting protected replicas"
        details = ", ".join(
            f"{self._NAMES[d]} ({_num(node.free[d])} free of {_num(need[d])})" for d in missing
        )
        return (
            f"no single node has {_describe(need)} free for profile {profile}; "
            f"the closest is {node.name}, short on {details}"
        )
