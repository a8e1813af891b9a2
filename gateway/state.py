"""What the gateway routes by, kept in each gateway process's memory.

A request reads nothing from the database: the catalog, the replicas in routing, the gateway
keys (their hashes and limits), the teams and which on-demand models fit on no node are a
`Snapshot` held here, replaced whole when something changed (keys excepted: `Keys`, one table
every Snapshot shares). A thread of its own in each process (`GatewayState._run`) learns of
changes from the database (access.triggers) and reads again; it also makes the writes a request
implies (an on-demand model's idle clock, a key's last use), off the request's path. How soon a
change is seen, and at what cost: docs/scaling.md#how-the-gateway-runs-and-how-it-scales-out.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import close_old_connections, connection
from django.utils import timezone

from access import routed, services, traffic, triggers
from access.models import DeletedGatewayKey, Team, UserWeight
from core.diskspace import disk_full, where_full
from fleet.selectors import fresh_engine_rows, reported_numbers, unplaceable_models
from llmgw.limitdefs import COUNTERS

from . import limits
from .limits import Budgets, Limits, key_ident, limits_of, no_budgets, team_ident
from .metrics import EngineFigures, Metrics, metrics
from .routing import Candidate, Catalog, Entry, read_catalog, read_replicas, replica_versions

if TYPE_CHECKING:
    from .loadsignal import LoadSignalBook

log = logging.getLogger("llmgw.gateway")

# How often the refresher looks for changes: on PostgreSQL it waits this long for a notification
# (LISTEN, delivered when the change commits), on SQLite it reads the one version number. A key
# or model name not found may be newer than the copy: its request waits for the next look before
# it is refused (gateway.relay), so made-up keys cost the database nothing, and a revoked key or
# a withdrawn replica is out within about this plus one read, well inside the drain that keeps a
# withdrawn replica running (fleet.services.DRAIN_SECONDS).
POLL_SECONDS = 0.05
# The budgets' tokens, which no notification covers, are read this often.
SAFETY_SECONDS = 5.0
# On PostgreSQL a replica's notification names it, and the refresher reads again only the
# replicas named (`Changes`, `refresh_replicas`): placing a model changes hundreds a second.
# Everything is read whole when anything else changed, or past MAX_NAMED; and at least this often
# everything is checked against the database, in case a notification was lost.
FULL_SECONDS = 60.0
# More replicas named by the notifications of one look than this: everything is read whole
# (one read of all is cheaper than this many by name), and no more names are kept.
MAX_NAMED = 5_000
# A burst of notifications is taken for at most this long before the look reads.
BURST_SECONDS = 0.2
# After a look that failed (the database away, a broken connection), the refresher starts over
# (a new connection, a new watcher) this much later; requests are served from memory meanwhile.
RETRY_SECONDS = 1.0
# The refresher's thread, by name (tests tell its database connection from theirs by it).
REFRESHER_THREAD = "llmgw-gateway-state"
# A key's last use is written at most this often per key and process.
LAST_USED_SECONDS = 60.0
# The bounds of what a process holds per key for writing last uses (GatewayState; their sum is
# llmgw_gateway_key_uses_entries). Key ids whose use waits to be written: emptied by every
# flush (every POLL_SECONDS), so they pile up only while the database is away; past this, the
# use of a key not already held is not kept (its last use is written at its next use once the
# database is back). About 60 bytes each, 6 MB at the bound.
MAX_PENDING_USES = 100_000
# Key ids whose last use was written less than LAST_USED_SECONDS ago (not written again
# meanwhile): past this, the older half is forgotten at once, and those keys' last use is
# written again at their next use (one UPDATE more each, never one less). About 100 bytes each.
MAX_WRITTEN_USES = 100_000
# How long a deleted key's hash is kept (gateway.DeletedGatewayKey). A process that has not
# read keys for nearly as long (its database away for a day) reads them all again instead.
DELETED_KEEP = timedelta(days=1)
DELETED_PRUNE_SECONDS = 600.0
# Keys changed this little before the last read's horizon are read again: it covers the
# database's clock stepping back and the instants between the steps of key_horizon.
KEY_MARGIN = timedelta(seconds=1)
# An hour of the database's clock and this process's apart is allowed for.
_KEYS_STALE_SECONDS = (DELETED_KEEP - timedelta(hours=1)).total_seconds()


@dataclass(frozen=True, slots=True)
class KeyState:
    id: int
    active: bool
    # Its owner's user id: the fair queue shares a model's slots between people, not keys.
    owner_id: int | None = None
    # Its limits, team and expiry: None for a key with none of them (most), which then costs
    # a request nothing more.
    limits: Limits | None = None

    @property
    def team_id(self) -> int | None:
        return None if self.limits is None else self.limits.team_id

    @property
    def expires_at(self) -> float | None:
        """Unix time after which the key opens nothing (None: never)."""
        return None if self.limits is None else self.limits.expires_at


class Keys(Mapping[str, KeyState]):
    """The gateway keys of active users, by their hash (hex), read incrementally.

    The first read takes every key; each later one (`refresh`) only the keys whose
    `changed_at` (set by the database, access.triggers) is at or after the last read's
    horizon, and the hashes deleted since (gateway.DeletedGatewayKey). A refresh therefore
    costs what changed, not how many keys there are. The table is changed in place, by the
    refresher alone (under a lock), while requests look keys up (one dict lookup each, atomic
    for Python); every Snapshot refers to it, so a change does not copy a million entries.

    Held: a key whose owner is active, revoked or not (a revoked one is refused saying so).
    A key of an inactive owner is dropped: it is refused as unknown.

    Memory, the bound: one dict entry per key, its sha256 as 32 raw bytes (72 bytes
    allocated, against 113 for the hex text) and one int for its owner, its id, whether it
    opens and whether it has limits (36 bytes), about 45 bytes of dict slot: about 155 bytes a
    key, 155 MB at 1 M keys (bench/gateway_keys.py measures it), with a second table during a full
    read only (the first, and one after the database was away for most of DELETED_KEEP).

    Keys with any limit, a team, an expiry or a weight other than 1 are also in a second,
    sparse table (key id -> gateway.limits.Limits: about 240 bytes each, 350 with two model
    globs, measured; `limited` counts them, llmgw_gateway_keys_limited shows it), read by
    the same changed_at read: a key without them costs nothing more.
    """

    def __init__(self, codes: dict[bytes, int] | None = None) -> None:
        # digest -> (owner << 64 | id) << 2 | limited << 1 | opens (pack_key): one int per key
        # rather than an object; and the limits of the keys that have any, by id. One tuple, replaced whole
        # by a full read, so a lookup never pairs one read's codes with another's limits.
        self._tables: tuple[dict[bytes, int], dict[int, Limits]] = (
            codes if codes is not None else {},
            {},
        )
        self._lock = threading.Lock()
        # Read next: keys changed (and hashes deleted) at or after these, in the database's
        # own form of a time (None: all of them).
        self._keys_since: Any = None
        self._deleted_since: Any = None
        self._pruned_at = float("-inf")
        # monotonic time of the last read that succeeded (a full one or a refresh)
        self.read_at = float("-inf")
        # What the last read took, for the bench and for /metrics: rows read, seconds.
        self.last_rows = 0
        self.last_seconds = 0.0
        self.full_reads = 0

    # -- lookups, on the request's path ----------------------------------------------------

    @property
    def _codes(self) -> dict[bytes, int]:
        return self._tables[0]

    @property
    def limited(self) -> int:
        """How many keys have limits, a team, an expiry or a weight (the sparse table)."""
        return len(self._tables[1])

    def budgeted(self) -> bool:
        """Whether any key has a token budget (else budgets need not be read)."""
        return any(limits.budgeted for limits in list(self._tables[1].values()))

    def get(self, digest: str, default: Any = None) -> Any:
        codes, limited = self._tables
        try:
            code = codes.get(bytes.fromhex(digest))
        except (ValueError, TypeError):
            return default
        if code is None:
            return default
        key_id, owner_id = (code >> 2) & _ID_MASK, code >> _OWNER_SHIFT
        if code & 2:
            return KeyState(key_id, bool(code & 1), owner_id, limited.get(key_id))
        return KeyState(key_id, bool(code & 1), owner_id)

    def __getitem__(self, digest: str) -> KeyState:
        key = self.get(digest)
        if key is None:
            raise KeyError(digest)
        return key

    def __len__(self) -> int:
        return len(self._codes)

    def __iter__(self) -> Iterator[str]:
        # list() copies the keys at once (under the GIL), so a refresh cannot change the
        # table while this iterates.
        return (digest.hex() for digest in list(self._codes))

    # -- reads, by the refresher -------------------------------------------------------------

    @classmethod
    def read(cls) -> Keys:
        keys = cls()
        keys.refresh()
        return keys

    def refresh(self) -> None:
        """Read what changed since the last read (everything the first time)."""
        with self._lock:
            started = time.perf_counter()
            stale = time.monotonic() - self.read_at > _KEYS_STALE_SECONDS
            if stale and self.read_at != float("-inf"):
                log.warning("gateway: keys not read for %s; reading them all again", DELETED_KEEP)
            keys_horizon, deleted_horizon = key_horizon()
            if stale:
                tables: tuple[dict[bytes, int], dict[int, Limits]] = ({}, {})
                rows = _read_keys(*tables, since=None)
                self._tables = tables  # one assignment: lookups see the old tables or the new
                self.full_reads += 1
            else:
                rows = _read_keys(*self._tables, since=self._keys_since)
                rows += _read_deleted(*self._tables, since=self._deleted_since)
            self._keys_since, self._deleted_since = keys_horizon, deleted_horizon
            self.read_at = time.monotonic()
            self.last_rows = rows
            self.last_seconds = time.perf_counter() - started
        if time.monotonic() - self._pruned_at >= DELETED_PRUNE_SECONDS:
            self._pruned_at = time.monotonic()
            _prune_deleted()


def key_horizon() -> tuple[Any, Any]:
    """The times from which the next read must take keys changed and hashes deleted.

    Taken before this read. Every key row not yet committed now, and every one written
    later, must have its time at or after the horizon, so that the next read, from there,
    finds it; committed ones this read finds itself.

    SQLite writes one transaction at a time: a row not committed yet is written after every
    committed one, so the horizon is the latest time already in the table.

    PostgreSQL commits concurrent transactions in any order: a row stamped a second ago may
    be committed after one stamped now. Its transaction has been open since before it wrote
    the row, and has a transaction id since writing anything, so the horizon is the start of
    the oldest open transaction that has written something (pg_stat_activity), or the
    database's clock before that look if there is none. This needs the gateway's database
    user to see the writers' sessions there (the same user, or one in pg_read_all_stats); a
    transaction writing keys for longer than KEY_MARGIN unseen by it could be missed.
    A transaction left open keeps the horizon back: each read then takes again every key
    changed since it began (a cost, not an error).

    Both are moved back by KEY_MARGIN, so a few keys are read twice, which is harmless.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT clock_timestamp()")
            (now,) = cursor.fetchone()
            cursor.execute(
                "SELECT min(xact_start) FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND backend_xid IS NOT NULL "
                "AND pid <> pg_backend_pid()"
            )
            (oldest,) = cursor.fetchone()
            horizon = min(now, oldest) if oldest is not None else now
            return horizon - KEY_MARGIN, horizon - KEY_MARGIN
        back = f"'-{KEY_MARGIN.total_seconds():g} seconds'"
        # (With parameters, even none, so that %% is read as %.)
        cursor.execute(
            f"SELECT strftime('%%Y-%%m-%%d %%H:%%M:%%f', max(changed_at), {back}) "
            "FROM gateway_gatewaykey",
            [],
        )
        (keys,) = cursor.fetchone()
        cursor.execute(
            f"SELECT strftime('%%Y-%%m-%%d %%H:%%M:%%f', max(deleted_at), {back}) "
            "FROM gateway_deletedgatewaykey",
            [],
        )
        (deleted,) = cursor.fetchone()
        return keys, deleted


# A key's code (Keys): its owner and id (database integers, below 2**63), whether it has
# limits and whether it opens.
_ID_MASK = (1 << 64) - 1
_OWNER_SHIFT = 66


def pack_key(key_id: int, owner_id: int, *, limited: bool, opens: bool) -> int:
    return (owner_id << 64 | key_id) << 2 | limited << 1 | opens


_KEY_ROWS = (
    "SELECT k.key_hash, k.id, k.owner_id, k.revoked_at IS NULL, u.is_active, k.team_id, "
    "k.expires_at, "
    + "".join(f"k.{name}, " for name in COUNTERS)
    + "k.models, k.weight FROM gateway_gatewaykey k JOIN auth_user u ON u.id = k.owner_id"
)
# How each database hands back a JSON list nobody filled in.
_NO_MODELS: tuple[Any, ...] = (None, "[]", [])
_CHUNK_ROWS = 10_000


def _digest(key_hash: Any) -> bytes | None:
    """A stored hash as bytes; None, with a warning, for one that is not a hex digest (no
    secret hashes to it, and one such row must not stop every other key from being read)."""
    try:
        return bytes.fromhex(key_hash)
    except (ValueError, TypeError):
        log.warning("gateway: a key's stored hash is not a hex digest; that key is skipped")
        return None


def _read_keys(codes: dict[bytes, int], limited: dict[int, Limits], *, since: Any) -> int:
    """Apply the keys changed since `since` (all when None) to `codes` and `limited`; the
    rows read."""
    if since is None:
        sql, params = f"{_KEY_ROWS} WHERE u.is_active", []
    else:
        sql, params = f"{_KEY_ROWS} WHERE k.changed_at >= %s", [since]
    rows = 0
    # The first read, on PostgreSQL, by a server-side cursor: a million rows come a chunk at a
    # time, not at once. Not a refresh: it reads what changed, a few rows, where a server-side
    # cursor costs three round trips (declare, fetch, close).
    with connection.chunked_cursor() if since is None else connection.cursor() as cursor:
        cursor.execute(sql, params)
        while chunk := cursor.fetchmany(_CHUNK_ROWS):
            rows += len(chunk)
            for (
                key_hash,
                key_id,
                owner_id,
                opens,
                owner_active,
                team_id,
                expires_at,
                *rest,
            ) in chunk:
                digest = _digest(key_hash)
                if digest is None:
                    continue
                if not owner_active:
                    codes.pop(digest, None)
                    limited.pop(key_id, None)
                    continue
                *counted, models, weight = rest
                if (
                    team_id is None
                    and expires_at is None
                    and all(figure is None for figure in counted)
                    and models in _NO_MODELS
                    and (weight is None or weight == 1)
                ):
                    codes[digest] = pack_key(key_id, owner_id, limited=False, opens=opens)
                    limited.pop(key_id, None)
                    continue
                limited[key_id] = limits_of(
                    **dict(zip(COUNTERS, counted, strict=True)),
                    models=models,
                    weight=weight,
                    team_id=team_id,
                    expires_at=expires_at,
                    ident=key_ident(key_hash),
                )
                codes[digest] = pack_key(key_id, owner_id, limited=True, opens=opens)
    return rows


def _read_deleted(codes: dict[bytes, int], limited: dict[int, Limits], *, since: Any) -> int:
    sql = "SELECT key_hash FROM gateway_deletedgatewaykey"
    params: list[Any] = []
    if since is not None:
        sql, params = f"{sql} WHERE deleted_at >= %s", [since]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchall()
    for (key_hash,) in found:
        digest = _digest(key_hash)
        code = None if digest is None else codes.pop(digest, None)
        if code is not None:
            limited.pop((code >> 2) & _ID_MASK, None)
    return len(found)


def _prune_deleted() -> None:
    """Forget deleted keys' hashes older than DELETED_KEEP: every process has read them."""

    DeletedGatewayKey.objects.filter(deleted_at__lt=timezone.now() - DELETED_KEEP).delete()


@dataclass(frozen=True)
class Snapshot:
    """What a request routes by, read whole from the database and replaced whole.

    The bound is the database's: one entry per catalog name (models and adapters), per replica
    in routing (not withdrawn, not failed), per team, per key or team with a token budget used
    this month, per on-demand model that fits on no node and per serving replica's engine
    figures. It holds what the database holds now, never what it held: the previous snapshot
    is dropped when this one replaces it. `size()` counts those entries
    (llmgw_gateway_snapshot_entries, set at each read); the keys are shared by every snapshot
    and counted apart (`Keys`, llmgw_gateway_keys_held).
    """

    catalog: Catalog
    replicas: dict[str, list[Candidate]]
    # Shared by every snapshot of a process and changed in place by its refresher (see Keys).
    keys: Keys
    unplaceable: dict[str, str]  # on-demand model -> why it fits on no node
    # What each serving replica's engine last reported of itself (fleet.selectors), for /metrics.
    # Every team's limits, by id (few rows: read whole when one changes), and the tokens the
    # database held this month for keys and teams with a budget (gateway.limits.Budgets).
    teams: dict[int, Limits] = field(default_factory=dict)
    budgets: Budgets = field(default_factory=no_budgets)
    # The people staff gave a weight in the fair queue, by user id (few rows: read whole).
    people: dict[int, float] = field(default_factory=dict)
    read_at: float = field(default_factory=time.monotonic)
    # When the catalog and every replica were last read whole (refresh_replicas keeps it).
    full_at: float = field(default_factory=time.monotonic)

    def size(self) -> int:
        """Its entries, keys aside (see the class's docstring)."""
        return (
            len(self.catalog.entries)
            + sum(len(candidates) for candidates in self.replicas.values())
            + len(self.teams)
            + len(self.people)
            + len(self.budgets.by_subject)
            + len(self.unplaceable)
        )


def read_snapshot(
    keys: Keys | None = None,
    counters: limits.SharedCounters | None = None,
    replicas: dict[str, list[Candidate]] | None = None,
) -> Snapshot:
    """Everything routing and /metrics need, in a few queries; `keys` are refreshed in place
    (only what changed), or read whole when not given; the replicas are read whole unless
    given (checked_replicas). A budget's tokens are read from the database less what this
    process's `counters` hold of them."""
    catalog = read_catalog()
    if replicas is None:
        replicas = read_replicas()
    if keys is None:
        keys = Keys.read()
    else:
        keys.refresh()
    teams = read_teams()
    budgets = no_budgets()
    if keys.budgeted() or any(team.budgeted for team in teams.values()):
        budgets = limits.read_budgets(counters.writers() if counters is not None else ())
    return Snapshot(
        catalog=catalog,
        replicas=replicas,
        keys=keys,
        unplaceable=_unplaceable(catalog),
        teams=teams,
        budgets=budgets,
        people=read_user_weights(),
    )


def refresh_replicas(previous: Snapshot, named: set[str]) -> Snapshot:
    """`previous` with the replicas in `named` read again (and dropped where they are no longer
    in routing, or no longer there), everything else kept as it was."""
    fresh = read_replicas(ids=named)
    replicas = {}
    for model, candidates in previous.replicas.items():
        if any(c.id in named for c in candidates):
            kept = [c for c in candidates if c.id not in named]
            if kept:
                replicas[model] = kept
        else:
            replicas[model] = candidates
    for model, candidates in fresh.items():
        replicas[model] = [*replicas.get(model, ()), *candidates]
    return replace(previous, replicas=replicas, read_at=time.monotonic())


def checked_replicas(
    previous: Snapshot, board: Metrics | None = None
) -> dict[str, list[Candidate]] | None:
    """Every replica in routing as the database holds it now, reading again only those whose
    row's version or node's address differs from what `previous` holds (PostgreSQL), or None
    when they must all be read (SQLite, or more than MAX_NAMED differ).

    The periodic look for what a lost notification would have missed: reading 20,000 replicas
    whole held a gateway process's GIL for about half a second every FULL_SECONDS, its event
    loop answering nodes and clients slowly meanwhile; the versions alone take a tenth of it."""
    if connection.vendor != "postgresql":
        return None
    now = replica_versions()
    held = {c.id: (c.version, c.address) for cs in previous.replicas.values() for c in cs}
    named = {pk for pk, seen in now.items() if held.get(pk) != seen}
    named.update(held.keys() - now.keys())
    if len(named) > MAX_NAMED:
        return None
    if board is not None:
        board.replicas_reread.inc(len(named))
    return refresh_replicas(previous, named).replicas if named else previous.replicas


def refresh_figures(previous: Snapshot, counters: limits.SharedCounters | None) -> Snapshot:
    """`previous` with what no notification covers read again: the budgets' tokens."""
    budgets = previous.budgets
    if previous.keys.budgeted() or any(team.budgeted for team in previous.teams.values()):
        budgets = limits.read_budgets(counters.writers() if counters is not None else ())
    return replace(previous, budgets=budgets, read_at=time.monotonic())


def read_teams() -> dict[int, Limits]:
    """Every team's limits, by id."""
    return {
        row["id"]: limits_of(
            **{name: row[name] for name in COUNTERS},
            models=row["models"],
            weight=row["weight"],
            team_id=row["id"],
            name=row["name"],
            ident=team_ident(row["id"], row["created_at"]),
        )
        # The fields are access.routed's, which the triggers watch: add one there, not here.
        for row in Team.objects.order_by().values(*routed.TEAM_LIMITS)
    }


def read_user_weights() -> dict[int, float]:
    """Each person's weight in the fair queue that staff set, by user id."""
    # The fields are access.routed's, which the triggers watch: add one there, not here.
    return dict(UserWeight.objects.order_by().values_list(*routed.USER_WEIGHTS))


def engine_figures() -> tuple[EngineFigures, ...]:
    """The serving replicas' engine numbers, fresh ones only (fleet.selectors.engine_numbers),
    read as rows: what /metrics shows (gateway.app), read when it is asked."""
    now = timezone.now()
    figures = []
    for replica_id, model_name, node_name, reported, at, slots in fresh_engine_rows():
        numbers = reported_numbers(reported, at, slots, now)
        if numbers is not None:
            figures.append(EngineFigures(model_name, str(replica_id), node_name, numbers))
    return tuple(figures)


def _unplaceable(catalog: Catalog) -> dict[str, str]:
    """On-demand models none of whose profiles fits on any schedulable node (fleet's rule), read
    by the fields access.routed names, which the triggers watch: add one there, not here."""
    on_demand = [e.name for e in catalog.entries.values() if e.on_demand and not e.adapter]
    return unplaceable_models(
        on_demand, node_fields=routed.NODE_PLACING, model_fields=routed.MODEL_PLACING
    )


class GatewayState:
    """The current snapshot, the refresher that replaces it, and the writes waiting for it:
    the traffic figures in `book` among them. One per gateway (gateway.app.Gateway)."""

    def __init__(
        self, book: traffic.TrafficBook | None = None, board: Metrics | None = None
    ) -> None:
        self.book = book if book is not None else traffic.TrafficBook()
        # The fair queue's figures for the autoscaler, written with the traffic (Gateway.started).
        self.load_signal: LoadSignalBook | None = None
        # The gateway's figures (gateway.process.Gateway.metrics), which the refresher sets.
        self.board = board if board is not None else metrics()
        # The gateway's limit counters, once made: a budget's reads leave out what their
        # writers (this machine's gateway processes) still hold.
        self.counters: limits.SharedCounters | None = None
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # monotonic time of the refresher's last look at the database (None: none yet)
        self.looked_at: float | None = None
        # Bounds (see MAX_PENDING_USES): _demand and _demand_written hold on-demand models of
        # the catalog, one entry each at most (llmgw_gateway_demand_entries); _used and
        # _used_written hold key ids, at most MAX_PENDING_USES and MAX_WRITTEN_USES
        # (llmgw_gateway_key_uses_entries).
        # model -> (its entry, whether it had nothing ready), until its idle clock is written.
        self._demand: dict[str, tuple[Entry, bool]] = {}
        # key ids used since the last flush (more only while the database is away).
        self._used: set[int] = set()
        # key id -> when its last use was written, oldest first; entries older than
        # LAST_USED_SECONDS are dropped once a LAST_USED_SECONDS, so this holds the keys used in
        # the last two minutes, and never more than MAX_WRITTEN_USES, not every key ever used.
        self._used_written: dict[int, float] = {}
        self._used_pruned_at = time.monotonic()
        # model -> when this process last wrote its idle clock (services.demand_every says how
        # often); one entry per on-demand model asked for, dropped with the old last uses.
        self._demand_written: dict[str, float] = {}

    # -- reads, on the request's path ---------------------------------------------------

    def get(self) -> Snapshot:
        snapshot = self._snapshot
        if snapshot is None:
            # Only before the refresher's first read (and in tests): read it here, once.
            with self._lock:
                if self._snapshot is None:
                    self._snapshot = read_snapshot(counters=self.counters)
                snapshot = self._snapshot
        return snapshot

    def looked_since(self, moment: float) -> bool:
        """Has the refresher looked at the database since `moment` (or is there none to wait
        for)? A refresher still taking its first look has not: a key made while it reads is
        waited for, not refused on what the process read as it started."""
        if self._thread is None:
            return True
        looked = self.looked_at
        return looked is not None and looked > moment

    # -- what requests leave to write -----------------------------------------------------

    def asked_for(self, entry: Entry, *, nothing_ready: bool) -> None:
        if not entry.on_demand:
            return
        with self._lock:
            _, already = self._demand.get(entry.model, (entry, False))
            self._demand[entry.model] = (entry, already or nothing_ready)
        if nothing_ready:
            self._wake.set()

    def key_used(self, key_id: int) -> None:
        used = self._used
        if len(used) < MAX_PENDING_USES:
            used.add(key_id)

    def sizes(self) -> tuple[int, int]:
        """Entries held for writing: (on-demand models, key ids) (see MAX_PENDING_USES)."""
        return (
            len(self._demand) + len(self._demand_written),
            len(self._used) + len(self._used_written),
        )

    def flush(self) -> None:
        """Write what requests left: idle clocks (waking on-demand models) and keys' last use.

        What cannot be written (the database is away) is kept for the next flush, merged with
        what came since: nothing is lost and nothing is written twice (up to MAX_PENDING_USES
        keys' last uses: past that, a key's use waits for its next one)."""
        try:
            self._flush()
        finally:
            demand, key_uses = self.sizes()
            board = self.board
            board.demand_entries.set(demand)
            board.key_uses_entries.set(key_uses)

    def _flush(self) -> None:
        with self._lock:
            demand, self._demand = self._demand, {}
        now = time.monotonic()
        pending = list(demand.values())
        try:
            while pending:
                entry, nothing_ready = pending[0]
                last = self._demand_written.get(entry.model)
                every = services.demand_every(entry.idle_timeout, nothing_ready=nothing_ready)
                if last is None or now - last >= every:
                    services.model_asked_for(entry.model)
                    self._demand_written[entry.model] = now
                pending.pop(0)
        except BaseException:
            with self._lock:
                for entry, nothing_ready in pending:
                    _, already = self._demand.get(entry.model, (entry, False))
                    self._demand[entry.model] = (entry, already or nothing_ready)
            raise
        used, self._used = self._used, set()
        due = [
            key_id
            for key_id in used
            if now - self._used_written.get(key_id, -LAST_USED_SECONDS) >= LAST_USED_SECONDS
        ]
        if due:
            try:
                services.keys_used(due)
            except BaseException:
                self._used |= used
                if len(self._used) > MAX_PENDING_USES:
                    self._used = set(itertools.islice(self._used, MAX_PENDING_USES))
                raise
            written = self._used_written
            for key_id in due:
                written.pop(key_id, None)  # to the end: the dict stays oldest first
                written[key_id] = now
            if len(written) > MAX_WRITTEN_USES:
                # The newer half stays (O(n) once per MAX_WRITTEN_USES / 2 keys written).
                self._used_written = dict(
                    itertools.islice(written.items(), len(written) - MAX_WRITTEN_USES // 2, None)
                )
        if now - self._used_pruned_at >= LAST_USED_SECONDS:
            self._used_pruned_at = now
            self._used_written = {
                key_id: at
                for key_id, at in self._used_written.items()
                if now - at < LAST_USED_SECONDS
            }
            self._demand_written = {
                model: at
                for model, at in self._demand_written.items()
                if now - at < LAST_USED_SECONDS
            }
        if self.book.due():
            try:
                self.book.flush()
            except Exception:
                # Figures are kept for the next flush; routing must not wait on them.
                log.exception("gateway: could not write traffic figures; trying again later")
            self.board.traffic_entries.set(self.book.size())
        signal = self.load_signal
        if signal is not None and signal.due():
            try:
                signal.write()
            except Exception:
                log.exception("gateway: could not write its queue figures; trying again later")

    # -- the refresher ------------------------------------------------------------------

    def reload(self) -> Snapshot:
        """Read everything again."""
        previous = self._snapshot
        return self._replace(
            read_snapshot(previous.keys if previous is not None else None, self.counters)
        )

    def check(self) -> Snapshot:
        """The periodic look (every FULL_SECONDS): everything read again, the replicas only
        where their rows changed (checked_replicas)."""
        previous = self._snapshot
        if previous is None:
            return self.reload()
        return self._replace(
            read_snapshot(
                previous.keys, self.counters, replicas=checked_replicas(previous, self.board)
            )
        )

    def refresh(self, changes: Changes) -> Snapshot:
        """Read again what `changes` says changed: everything, or the replicas it names."""
        previous = self._snapshot
        if previous is None or changes.everything:
            return self.reload()
        return self._replace(refresh_replicas(previous, changes.replicas))

    def _replace(self, snapshot: Snapshot) -> Snapshot:
        self._snapshot = snapshot
        board = self.board
        board.keys_held.set(len(snapshot.keys))
        board.keys_limited.set(snapshot.keys.limited)
        board.snapshot_entries.set(snapshot.size())
        board.key_refresh.observe(snapshot.keys.last_seconds)
        return snapshot

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=REFRESHER_THREAD, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.looked_at = None

    def _run(self) -> None:
        watcher: _Watcher | None = None
        lost_at: float | None = None  # monotonic time the database was lost; None while up
        self.board.database_up.set(1)
        while not self._stop.is_set():
            try:
                # looked_at is when a look began reading, not when it ended: a request for a key
                # committed after the read began (and so perhaps not in it) must wait for the
                # next look, not be refused on this one (gateway.relay.fresh_look).
                if watcher is None:
                    watcher = _watcher()
                    began = time.monotonic()
                    self.reload()
                    self.looked_at = began
                changes = watcher.changed(POLL_SECONDS, self._wake)
                self._wake.clear()
                snapshot = self._snapshot
                clock = time.monotonic()
                if snapshot is None:
                    self.reload()
                elif clock - snapshot.full_at >= FULL_SECONDS:
                    self.check()
                elif changes:
                    self.refresh(changes)
                elif clock - snapshot.read_at >= SAFETY_SECONDS:
                    self._replace(refresh_figures(snapshot, self.counters))
                self.looked_at = watcher.seen_from
                self.flush()
                if lost_at is not None:
                    log.warning(
                        "gateway: the database is back after %.0f s; what was kept is written",
                        time.monotonic() - lost_at,
                    )
                    lost_at = None
                    self.board.database_up.set(1)
            except Exception as exc:
                # The database is away, or a connection broke: keep serving from memory, and
                # start over (a new connection, a full read) in a moment. One line when it goes
                # and one when it is back, not one a retry.
                if lost_at is None:
                    lost_at = time.monotonic()
                    self.board.database_up.set(0)
                    self.board.database_outages.inc()
                    full = disk_full(exc)
                    log.warning(
                        "gateway: lost the database (%s); serving keys, models and replicas "
                        "from memory, keeping what requests leave to write",
                        _one_line(exc) if full is None else where_full(full).text(),
                    )
                else:
                    log.debug("gateway: the database is still away", exc_info=True)
                if watcher is not None:
                    watcher.close()
                watcher = None
                close_old_connections()
                connection.close()
                self._stop.wait(RETRY_SECONDS)
        if watcher is not None:
            watcher.close()
        connection.close()


def _one_line(exc: BaseException) -> str:
    """An exception as a short phrase for a log line: its type and the first line of its text."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


@dataclass
class Changes:
    """What the notifications of one look say changed: everything, or only the replicas named
    (at most MAX_NAMED of them: past that, everything). False when nothing did."""

    everything: bool = False
    replicas: set[str] = field(default_factory=set)

    @classmethod
    def all(cls) -> Changes:
        return cls(everything=True)

    def __bool__(self) -> bool:
        return self.everything or bool(self.replicas)

    def take(self, payload: str) -> None:
        """One notification's payload (access.triggers): a replica's id after REPLICA_PREFIX,
        anything else for a change of something else."""
        if self.everything:
            return
        if payload.startswith(triggers.REPLICA_PREFIX) and len(self.replicas) < MAX_NAMED:
            self.replicas.add(payload[len(triggers.REPLICA_PREFIX) :])
        else:
            self.everything = True
            self.replicas.clear()


class _Watcher:
    # Set by changed(): every change committed before this moment (monotonic) is in what it
    # reported, so a reload after it holds them.
    seen_from = float("-inf")

    def changed(self, timeout: float, wake: threading.Event) -> Changes:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _VersionPoll(_Watcher):
    """SQLite (and any other database): read the version row the triggers bump."""

    def __init__(self) -> None:
        self.version = self._read()

    def _read(self) -> int:
        # Straight on the database driver's connection: Django's cursor costs ten times the
        # query, and this runs twenty times a second in every gateway process.
        connection.ensure_connection()
        assert connection.connection is not None
        cursor = connection.connection.cursor()
        try:
            cursor.execute("SELECT version FROM gateway_routingversion WHERE id = 1")
            row = cursor.fetchone()
        finally:
            cursor.close()
        return int(row[0]) if row else 0

    def changed(self, timeout: float, wake: threading.Event) -> Changes:
        wake.wait(timeout)
        # A change committed before the read bumped the version it reads.
        self.seen_from = time.monotonic()
        version = self._read()
        if version == self.version:
            return Changes()
        self.version = version
        return Changes.all()


class _Listen(_Watcher):
    """PostgreSQL: LISTEN on a connection of its own; notifications come when changes commit."""

    def __init__(self) -> None:
        params = connection.get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        params.pop("prepare_threshold", None)
        self.conn = psycopg.connect(**params, autocommit=True)
        self.conn.execute(f"LISTEN {triggers.CHANNEL}")

    def changed(self, timeout: float, wake: threading.Event) -> Changes:
        # A change committed before the wait notified by then; its notification is read in it.
        self.seen_from = time.monotonic()
        changes = Changes()
        for notice in self.conn.notifies(timeout=timeout, stop_after=1):
            changes.take(notice.payload)
        if changes:
            # Take the rest of a burst at once: one read for all of them, but not forever: a
            # burst that goes on (a model of thousands placed) is read a part at a time.
            until = time.monotonic() + BURST_SECONDS
            while time.monotonic() < until:
                took = 0
                for notice in self.conn.notifies(timeout=0.01, stop_after=1000):
                    changes.take(notice.payload)
                    took += 1
                if not took:
                    break
        return changes

    def close(self) -> None:
        self.conn.close()


def _watcher() -> _Watcher:
    connection.ensure_connection()
    if connection.vendor == "postgresql":
        return _Listen()
    return _VersionPoll()
