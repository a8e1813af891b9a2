"""Where a request goes: the names there are, the replicas that can answer, and the choice among them.

The reads here (`read_catalog`, `read_replicas`) are made by gateway.state, which
keeps their results in each gateway process's memory and reads them again when
the database says something changed; a request itself reads nothing.

The decision itself (`decide`) is a pure function of those reads, so that it can be
tested without a fleet.
"""

from __future__ import annotations

import difflib
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from django.db import connection
from django.db.models import CharField, Value
from django.db.models.expressions import RawSQL

from access import routed
from catalog.definitions import MAX_NAME, NAME_PATTERN
from catalog.models import (
    CanaryRouting,
    Model,
    canary_routing,
    engine_of,
    is_on_demand,
    is_parked,
)
from fleet.models import Replica
from fleet.specs import engine_key, replica_revision
from llmgw.engines import DEFAULT_ENGINE, Engine, get_engine
from llmgw.engines.base import key_headers

from .load import SharedLoad
from .prefix import SLACK, PrefixTable

MAX_REMEMBERED_REPLICAS = 1000
STARTING_STATES = (Replica.PENDING, Replica.FETCHING, Replica.STARTING)


@dataclass(frozen=True)
class Entry:
    """A name a request may ask for: a model, or an adapter served by its base model's replicas."""

    name: str
    model: str  # the catalog model whose replicas serve this name
    adapter: bool
    on_demand: bool
    parked: bool
    fallbacks: tuple[str, ...]
    idle_timeout: int  # seconds; 0 = the cluster default
    owner: str | None
    created: int  # unix time, for /v1/models
    # "prefix": requests go where their prompt's beginning was computed lately
    # (gateway.prefix); "least_loaded": to the replica with the most free slots.
    routing: str = "prefix"
    # A canary update under way: its revision gets `percent` of the requests (gateway.canary).
    canary: CanaryRouting | None = None
    # The context its engines are started with (None: its engine's default): the most tokens
    # an answer without max_tokens may have, what a request reserves of a token limit.
    context_length: int | None = None
    # Its engines are started with a vision projector (the catalog's mmproj): they take images.
    vision: bool = False
    # Its engines rank documents instead of computing embeddings (the catalog's reranking).
    reranking: bool = False
    # The engine its replicas run (llmgw.engines' name).
    engine: str = DEFAULT_ENGINE

    @property
    def backend(self) -> Engine:
        return get_engine(self.engine)

    def serves(self, feature: str) -> bool:
        """Whether its engines serve `feature` (an endpoint's `needs`), as the engine's features
        say (Engine.serves): a reranker's engines rank, any other model's compute embeddings."""
        return self.backend.serves(feature, reranking=self.reranking)

    def answers(self, path: str) -> bool:
        """Whether its engine answers the endpoint at `path` (Features.endpoints)."""
        served = self.backend.features.endpoints
        return served is None or path in served

    @property
    def most_tokens(self) -> int:
        """The most tokens one answer may have without a max_tokens: its context (an engine
        generates until it is full), its engine's default where the catalog sets none."""
        return self.context_length or self.backend.default_context_length


@dataclass(frozen=True)
class Catalog:
    entries: dict[str, Entry]
    read_at: float  # time.monotonic()

    def usable(self) -> list[Entry]:
        """What /v1/models lists: every name a request can get an answer for."""
        return [
            e
            for e in self.entries.values()
            if not self.entries[e.model].parked or self.entries[e.model].fallbacks
        ]


def read_catalog() -> Catalog:
    """Every model and adapter, in one query."""
    entries: dict[str, Entry] = {}
    # order_by(): no ORDER BY from Meta.ordering, which nothing here needs.
    # The fields are access.routed's, which the triggers watch: add one there, not here.
    rows = Model.objects.order_by().values(*routed.MODEL_ROUTING)
    for row in rows:
        model = Entry(
            name=row["name"],
            model=row["name"],
            adapter=False,
            on_demand=is_on_demand(row["min_replicas"], row["max_replicas"]),
            parked=is_parked(row["min_replicas"], row["max_replicas"]),
            fallbacks=tuple(row["fallbacks"] or ()),
            idle_timeout=row["idle_timeout"],
            owner=row["owner__username"],
            created=int(row["created_at"].timestamp()),
            routing=row["routing"] or "prefix",
            canary=canary_routing(row["canary"]),
            context_length=row["context_length"],
            vision=bool(row["mmproj"]),
            reranking=row["reranking"],
            engine=engine_of(row["engine"]),
        )
        entries[model.name] = model
        for adapter in row["adapters"] or ():
            entries[adapter["name"]] = replace(model, name=adapter["name"], adapter=True)
    return Catalog(entries=entries, read_at=time.monotonic())


# -- replicas ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A replica as routing sees it."""

    id: str
    model: str
    state: str
    address: str
    port: int
    adapters: frozenset[str] = field(default_factory=frozenset)
    # Requests the engine computes at once (its parallel slots); 1 = one at a time.
    slots: int = 1
    # The adapters (name, scale) in the order the engine was started with them.
    lora: tuple[tuple[str, float], ...] = ()
    # The weights it serves (fleet.specs.weights_revision): old or new during a canary.
    revision: str = ""
    # Its engine's key (fleet.specs.engine_key), sent with every request; "" for none.
    key: str = field(default="", repr=False)
    # Its row's version when it was read (PostgreSQL's xmin; "" on SQLite): what
    # replica_versions is compared with.
    version: str = field(default="", repr=False, compare=False)
    # The engine it runs (llmgw.engines' name), as its spec says.
    engine: str = DEFAULT_ENGINE

    @cached_property
    def headers(self) -> dict[str, str]:
        """The headers of a request to its engine (made once per replica and snapshot)."""
        return {"Content-Type": "application/json", **key_headers(self.key)}

    def engine_lora(self, name: str) -> list[dict[str, Any]] | None:
        """The request's ``lora`` field that makes this engine answer as ``name``: that
        adapter at its scale, the others at 0 (all at 0 for the base model); None when the
        engine has no adapters. See the engine's lora_request (llmgw.engines)."""
        if not self.lora:
            return None
        return get_engine(self.engine).lora_request(
            [{"name": n, "scale": s} for n, s in self.lora], name
        )

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def ready(self) -> bool:
        return self.state == Replica.READY

    def serves(self, entry: Entry) -> bool:
        # The engine answers a name it does not know with the base model, silently:
        # an adapter goes only to replicas started with it.
        return not entry.adapter or entry.name in self.adapters


def _in_routing() -> Any:
    """The replicas in routing: not withdrawn, not failed, of a model in the catalog."""
    # The fields, and those it filters by, are access.routed's, which the triggers watch.
    return (
        Replica.objects.filter(model__isnull=False, withdrawn_at__isnull=True)
        .exclude(state=Replica.FAILED)
        .order_by()
    )


def _with_version(rows: Any) -> Any:
    """`rows` with each one's version (see Candidate.version)."""
    if connection.vendor != "postgresql":
        return rows.annotate(version=Value("", output_field=CharField()))
    return rows.annotate(version=RawSQL(f'"{Replica._meta.db_table}"."xmin"::text', ()))


def replica_versions() -> dict[str, tuple[str, str]]:
    """Every replica in routing, by id: (its row's version, its node's address). Much cheaper
    than read_replicas (no spec to decode, nothing to build): compared with what a process
    holds, it names the replicas to read again (gateway.state)."""
    rows = _with_version(_in_routing()).values_list("id", "version", "node__address")
    return {str(pk): (version, address) for pk, version, address in rows}


def read_replicas(
    models: Iterable[str] | None = None, ids: Iterable[str] | None = None
) -> dict[str, list[Candidate]]:
    """The replicas in routing (not withdrawn, not failed), by model, in one query; all
    models' unless `models` names some, all replicas unless `ids` names some."""
    found: dict[str, list[Candidate]] = {}
    rows = _with_version(_in_routing()).values(*routed.REPLICA_ROUTING, "version")
    if models is not None:
        rows = rows.filter(model_name__in=list(models))
    if ids is not None:
        rows = rows.filter(id__in=list(ids))
    for row in rows:
        state, port, spec = row["state"], row["port"], row["spec"]
        if state == Replica.READY and port is None:
            continue  # cannot happen with a well-behaved agent; nothing to send to
        replica_id = str(row["id"])
        found.setdefault(row["model_name"], []).append(
            Candidate(
                id=replica_id,
                model=row["model_name"],
                state=state,
                address=row["node__address"],
                port=port or 0,
                adapters=frozenset(a["name"] for a in (spec or {}).get("adapters", [])),
                slots=_slots(spec),
                lora=tuple(
                    (a["name"], float(a.get("scale", 1.0)))
                    for a in (spec or {}).get("adapters", [])
                ),
                revision=replica_revision(spec),
                key=engine_key(replica_id),
                version=row["version"],
                engine=_engine_of(spec),
            )
        )
    return found


def _engine_of(spec: dict | None) -> str:
    """The engine a replica runs, as its spec says (the default one when it does not)."""
    value = (spec or {}).get("engine")
    return value if isinstance(value, str) and value else DEFAULT_ENGINE


def _slots(spec: dict | None) -> int:
    """How many requests the replica's engine computes at once, when its spec says so."""
    value = (spec or {}).get("slots")
    return value if isinstance(value, int) and value > 0 else 1


# -- the decision -----------------------------------------------------------------------


@dataclass(frozen=True)
class Serve:
    """Send the request to one of `candidates` (all ready), asking the engine for `engine_name`."""

    model: str  # the catalog name that answers: the one asked for, or a fallback
    engine_name: str
    candidates: tuple[Candidate, ...]
    fallback_from: str | None = None


@dataclass(frozen=True)
class Wait:
    """Nothing ready yet, but a replica is on its way (on demand, or being placed)."""

    model: str
    on_demand: bool


@dataclass(frozen=True)
class Unavailable:
    message: str
    retry_after: int


Decision = Serve | Wait | Unavailable


def decide(
    entry: Entry,
    replicas: dict[str, list[Candidate]],
    catalog: Catalog,
    *,
    may_wait: bool,
    unplaceable: dict[str, str] | None = None,
    path: str | None = None,
    needs: str | None = None,
) -> Decision:
    """Where a request for `entry` goes now, given the replicas in routing.

    Its own ready replicas first. With none, it waits (when `may_wait`) if one is on
    its way: an on-demand model being loaded, or a replica being placed. Otherwise
    the first of its fallbacks, in order, with a ready replica answers; an adapter
    falls back as its base model does, to the fallback model itself. Fallbacks are
    not followed further (a fallback's own fallbacks) nor woken when on demand: a
    fallback is a stand-in that is there now, not a second wait.

    A request to the endpoint at `path` (needing the engine feature `needs`, if any) falls
    back only to a model whose engine answers it: one of another engine that does not would
    answer an error of its own for what the model asked for serves (`Entry.answers`).

    An on-demand model with nothing placed that fits on no node (`unplaceable`
    names it, with the reason) is not waited for: no wait would end otherwise.
    """
    mine = [c for c in replicas.get(entry.model, []) if c.serves(entry)]
    ready = tuple(c for c in mine if c.ready)
    if ready:
        return Serve(model=entry.name, engine_name=entry.name, candidates=ready)
    starting = any(c.state in STARTING_STATES for c in mine)
    cannot_place = (unplaceable or {}).get(entry.model) if entry.on_demand and not mine else None
    if cannot_place is not None:
        may_wait = False
    if may_wait and (entry.on_demand or starting):
        return Wait(model=entry.model, on_demand=entry.on_demand)
    unfit: list[str] = []
    for fallback in entry.fallbacks:
        target = catalog.entries.get(fallback)
        if target is None:
            continue  # removed since; validation keeps this rare
        if (path is not None and not target.answers(path)) or (
            needs is not None and not target.serves(needs)
        ):
            unfit.append(fallback)
            continue
        ready = tuple(c for c in replicas.get(fallback, []) if c.ready and c.serves(target))
        if ready:
            return Serve(
                model=fallback, engine_name=fallback, candidates=ready, fallback_from=entry.name
            )
    return Unavailable(
        message=_why_unavailable(entry, starting, cannot_place, unfit, path),
        retry_after=60 if cannot_place else 10,
    )


def _why_unavailable(
    entry: Entry,
    starting: bool,
    cannot_place: str | None = None,
    unfit: Sequence[str] = (),
    path: str | None = None,
) -> str:
    what = f"{entry.name} (an adapter of {entry.model})" if entry.adapter else entry.name
    tried_ones = [name for name in entry.fallbacks if name not in unfit]
    tried = f"; its fallbacks ({', '.join(tried_ones)}) have none either" if tried_ones else ""
    if unfit:
        tried += (
            f"; {'its fallback' if len(unfit) == 1 else 'its fallbacks'} ({', '.join(unfit)}) "
            f"cannot answer {path or 'this endpoint'}"
        )
    if cannot_place is not None:
        return (
            f"{what} cannot be started: {cannot_place}{tried}. Add a node that is large enough, "
            f"or give the model a smaller profile (`llmgw ctl model resources {entry.model}`)."
        )
    if entry.parked:
        return (
            f"{what} is in the catalog but deliberately not running (min 0, max 0){tried}. "
            f"Its owner can start it with `llmgw ctl scale {entry.model} --min 1`."
        )
    if entry.on_demand or starting:
        return (
            f"{what} is being started and was not ready in time{tried}. "
            "Try again shortly; the Retry-After header says when."
        )
    return (
        f"{what} has no ready replica right now{tried}. "
        f"Try again shortly; `llmgw ctl model target {entry.model}` shows why."
    )


# -- choosing a replica -----------------------------------------------------------------


@dataclass(eq=False)
class Hold:
    """A slot counted in flight on `replica` for one request before the balancer has chosen
    where the request goes (a turn granted by gateway.fairqueue): every gateway process sees the
    slot taken from then on. The request's choice takes the count over (`Balancer.choose` with
    `hold`), so the slot never looks free in between; `Balancer.give_back` returns it when no
    choice came."""

    replica: Candidate
    taken: bool = False


class Balancer:
    """Requests in flight per replica, over every gateway process on this machine (see
    gateway.load), and the choice of the replica with the most free slots.

    An engine computes `slots` requests at once (1 unless its replica says more), so
    the replica with the most slots free is the one that answers soonest. Ties are
    broken first by which replica this process last sent the same name to (an engine
    switching between a base model and an adapter reloads it), then at random, so
    that processes do not all pick the same replica.

    Given the prompt's block hashes (gateway.prefix), the replica that served the longest
    beginning of it recently is taken instead when that is worth it (_worth_waiting_for): its
    KV cache already holds that beginning.
    """

    def __init__(self, load: SharedLoad | None = None, prefixes: PrefixTable | None = None) -> None:
        self.load = load if load is not None else SharedLoad(None)
        self.prefixes = prefixes if prefixes is not None else PrefixTable(None)
        self._lock = threading.Lock()
        self._last_name: dict[str, str] = {}
        # For /metrics: how many replicas' last names are remembered, when that changes.
        self.on_remembered: Callable[[int], None] | None = None
        # Why the last choice was made ("prefix": its engine computed the prompt's beginning
        # lately; "least loaded"; "the only one"), read right after choose() for the trace.
        self.reason = ""

    def choose(
        self,
        candidates: Iterable[Candidate],
        engine_name: str,
        prefix: Sequence[int] = (),
        *,
        hold: Hold | None = None,
    ) -> Candidate:
        """Pick one and count a request in flight on it; call release() when it is done. A
        `hold` not yet taken is this request's own slot: not counted against its replica here,
        and its count becomes the choice's."""
        with self._lock:
            choices = list(candidates)
            held = hold.replica.id if hold is not None and not hold.taken else None
            if len(choices) == 1:
                # Nothing to weigh: no load read, no scoring.
                choice = choices[0]
                self.reason = "the only one"
            else:
                choice = self._least_busy(choices, engine_name, held, prefix)
            if choice.id != held:
                self.load.add(choice.id, 1)
                if held is not None:
                    # Counted on the choice before the hold goes: the request is counted
                    # somewhere at every instant.
                    self.load.add(held, -1)
            if hold is not None:
                hold.taken = True
            remembered = len(self._last_name)
            if remembered >= MAX_REMEMBERED_REPLICAS:
                # Replicas come and go with every rollout; forget the ones idle here.
                self._last_name = {r: n for r, n in self._last_name.items() if self.load.mine(r)}
            self._last_name[choice.id] = engine_name
            if len(self._last_name) != remembered and self.on_remembered is not None:
                self.on_remembered(len(self._last_name))
        if prefix:
            self.prefixes.remember(prefix, choice.id)
        return choice

    def _least_busy(
        self, choices: list[Candidate], engine_name: str, held: str | None, prefix: Sequence[int]
    ) -> Candidate:
        """Of several: the least busy (the one that last served the same name among equals, then
        at random), unless the one with the prompt's beginning cached is worth the wait."""
        now = time.monotonic()
        busy = {c.id: self.load.total(c.id, now) - c.slots for c in choices}
        if held in busy:
            busy[held] -= 1
        choice = min(
            choices,
            key=lambda c: (
                busy[c.id],
                self._last_name.get(c.id) != engine_name,
                random.random(),
            ),
        )
        self.reason = "least loaded"
        if prefix:
            found = self.prefixes.longest(prefix, [c.id for c in choices])
            if found is not None and _worth_waiting_for(busy[found[0]], busy[choice.id]):
                choice = next(c for c in choices if c.id == found[0])
            if found is not None and found[0] == choice.id:
                self.reason = "prefix"
        return choice

    def release(self, candidate: Candidate) -> None:
        with self._lock:
            self.load.add(candidate.id, -1)

    def hold(self, replica: Candidate) -> Hold:
        """Count a slot of `replica` for a request that has not chosen yet (see Hold)."""
        with self._lock:
            self.load.add(replica.id, 1)
        return Hold(replica)

    def give_back(self, hold: Hold) -> None:
        """Return a hold that no choice took (a request that left before it chose)."""
        with self._lock:
            if not hold.taken:
                hold.taken = True
                self.load.add(hold.replica.id, -1)

    def in_flight(self, replica_id: str) -> int:
        """This process's requests in flight on the replica."""
        return self.load.mine(replica_id)


def _worth_waiting_for(cached: int, least: int) -> bool:
    """Send to the replica with the prompt's beginning cached rather than the least busy one?

    Both are "requests in flight minus slots": below 0, a slot is free. A free slot on the
    cached replica: yes. None there while the least busy has one: no, a request would queue
    behind others although an engine is idle (prefill is cheaper than that wait). Neither has
    one: yes, while the cached one is at most prefix.SLACK requests further behind.
    """
    if cached < 0:
        return True
    if least < 0:
        return False
    return cached <= least + SLACK


# The did-you-mean compares the asked name with at most this many names (difflib costs about
# 20 µs a pair): bounded work for a 404 on a large catalog. Past it, no suggestions.
CLOSEST_SEARCH_LIMIT = 2000


def entry_names_closest_first(name: str, names: Iterable[str], *, limit: int = 20) -> list[str]:
    """The names there are, those closest to `name` first, for a 404's message.

    A name that no model could have (too long, or characters a name cannot have) is compared
    with nothing: a client's 1 MB name would cost difflib a table of its every character."""
    known = sorted(set(names))
    possible = len(name) <= MAX_NAME and NAME_PATTERN.fullmatch(name) is not None
    if not possible or len(known) > CLOSEST_SEARCH_LIMIT:
        return known[:limit]
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    ordered = close + [n for n in known if n not in close]
    return ordered[:limit]
