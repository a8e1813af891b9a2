"""Per-key and per-team limits, counted across every gateway process of this machine.

What a key or team may use (access.models.LimitFields) is held in memory (gateway.state); this
module counts what is used against it and decides, for one request, before any replica is
chosen: in the order checked, the key's then its team's requests in flight, requests per
minute, tokens per minute, tokens today and tokens this month (UTC). The counts of every process
of the machine are checked and added to under one lock (`SharedCounters`), so the limits are
exact across them; gateway.redislimits counts across machines. Keys without limits, a team or an
expiry are not counted, and cost nothing. The design: docs/sharing.md#how-limits-are-counted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import re
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from fnmatch import translate
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Case, CharField, F, IntegerField, Q, Sum, Value, When

from access.live import LiveUse
from access.models import KeyUsageDay
from core.diskspace import allocate

from . import boards, conf
from .redislimits import Counted, Decided, RedisLimits, read_use

log = logging.getLogger("llmgw.gateway")

# A process's file counts SLOTS keys and teams (368 bytes each, 12.1 MB of file, of which only the
# pages used take memory). A key or team takes a slot when it is first used (open addressing from
# a hash of its id, at most PROBE places from its home, tagged with its id, so two never share a
# count), and gives it up to another only when the slot is idle: nothing in flight, nothing in the
# last minute's buckets and nothing counted this month (_idle). So the bound is on limited keys
# and teams used this month per process (llmgw_gateway_limit_slots_held); one that finds no slot
# is refused with 503 limits_full, the only answer that keeps every limit true.
SLOTS = 32_768
PROBE = 64
# Requests and tokens per minute are counted in BUCKETS of BUCKET_SECONDS. A request counts in the
# bucket it was admitted in, its tokens (as the engine reported them; a stream's when it ends) in
# the bucket it ended in, and a bucket counts until 65 s after it began: never more than the limit
# in any 60 s, and what was used stops counting 60 to 65 s later (the reset the headers give).
BUCKET_SECONDS = 5
BUCKETS = 13  # 65 s: a bucket counts until 60 s after its last instant
# int64 fields of a slot
TAG, IN_FLIGHT, DAY, DAY_TOKENS, MONTH, MONTH_TOKENS, RESERVED = range(7)
STAMPS = 7
REQUESTS = STAMPS + BUCKETS
TOKENS = REQUESTS + BUCKETS
WIDTH = TOKENS + BUCKETS
BOARD_BYTES = (SLOTS + 1) * WIDTH * 8  # the first slot's place holds the writer's name
HEADER = WIDTH  # slot indexes are offset by one slot: the writer's name comes first
# int64 0 the length of the name of the traffic book's writer (Budgets), bytes 8-72 the name.
WRITER_BYTES = 64
# Each process's board is FILE_PREFIX-PID. The prefix names the layout: a file of another layout
# (a process of another version, during an upgrade) is neither read nor dropped.
FILE_PREFIX = "limits-v3"
LAYOUT = 3
# What a request reserves for its prompt beyond its body's bytes (see `reservation`).
TEMPLATE_TOKENS = 64


# -- what a key or team may use ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's or a team's limits, as the gateway holds them (None: no limit)."""

    rpm: int | None = None
    tpm: int | None = None
    max_parallel: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    models: tuple[str, ...] = ()
    weight: float = 1.0
    # A key's: its team and when it expires (unix time); a team's: its id and name.
    team_id: int | None = None
    expires_at: float | None = None
    name: str = ""
    # Its name in Redis, where several machines count together (gateway.redislimits): unique
    # among every database's keys and teams, as ids are not.
    ident: str = ""
    _pattern: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    @property
    def counted(self) -> bool:
        """Whether any of its limits needs counting."""
        return (
            self.rpm is not None
            or self.tpm is not None
            or self.max_parallel is not None
            or self.tokens_per_day is not None
            or self.tokens_per_month is not None
        )

    @property
    def rated(self) -> bool:
        """Whether it has a limit counted per minute or in flight (what Redis counts)."""
        return self.rpm is not None or self.tpm is not None or self.max_parallel is not None

    @property
    def budgeted(self) -> bool:
        return self.tokens_per_day is not None or self.tokens_per_month is not None

    @property
    def tokened(self) -> bool:
        """Whether it limits tokens (per minute, or a budget): what a request reserves against."""
        return self.tpm is not None or self.budgeted

    def allows(self, model: str) -> bool:
        """Whether a request may ask for `model` (a model or adapter name)."""
        return self._pattern is None or self._pattern.match(model) is not None


def without_tokens(limits: Limits) -> Limits:
    """The limits a request that uses no tokens is held to (a count of a prompt's tokens):
    requests per minute and in flight, not tokens."""
    return replace(limits, tpm=None, tokens_per_day=None, tokens_per_month=None)


def limits_of(
    *,
    rpm: int | None,
    tpm: int | None,
    max_parallel: int | None,
    tokens_per_day: int | None,
    tokens_per_month: int | None,
    models: Any,
    weight: float | None,
    team_id: int | None = None,
    expires_at: Any = None,
    name: str = "",
    ident: str = "",
) -> Limits:
    """Limits from a row's columns, as either database returns them."""
    if isinstance(models, str):
        models = json.loads(models or "[]")
    names = tuple(str(m) for m in (models or ()) if isinstance(m, str))
    # One pattern for every glob: fnmatch's own rules, case-sensitive as model names are.
    pattern = re.compile("|".join(translate(n) for n in names)) if names else None
    return Limits(
        rpm=rpm,
        tpm=tpm,
        max_parallel=max_parallel,
        tokens_per_day=tokens_per_day,
        tokens_per_month=tokens_per_month,
        models=names,
        weight=1.0 if weight is None else float(weight),
        team_id=team_id,
        expires_at=_unix(expires_at),
        name=name,
        ident=ident,
        _pattern=pattern,
    )


def _unix(moment: Any) -> float | None:
    if moment is None:
        return None
    if isinstance(moment, str):  # SQLite, read by a plain cursor: UTC without a zone
        moment = datetime.fromisoformat(moment)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return float(moment.timestamp())


def key_ident(key_hash: str) -> str:
    """A key's name in Redis: from its hash, which no other key in any database has."""
    return "k" + key_hash[:32]


def team_ident(team_id: int, created_at: Any) -> str:
    """A team's name in Redis: its id and when it was made (another database's team with the
    same id was made at another moment)."""
    stamp = _unix(created_at)
    return f"t{team_id}-{0 if stamp is None else round(stamp * 1e6)}"


def reservation(
    raw: bytes,
    body: dict[str, Any],
    most_tokens: int,
    answer_limit: tuple[str, ...] = ("max_completion_tokens", "max_tokens"),
) -> int:
    """The tokens a request may use, which it reserves against its key's and team's token
    limits while it is in flight: its prompt at most, and each answer's most.

    - The prompt: no tokenizer makes more tokens of a text than it has bytes (byte-level BPE
      and SentencePiece with byte fallback give each token one byte or more), and the body
      holds the prompt's text with more bytes around it (its JSON, a message's role) than a
      chat template adds around a message; TEMPLATE_TOKENS more for what a template adds once
      (the start token, a default system prompt).
    - The answers: n of them (per prompt, where a completion asks for several), each at most
      the first of the endpoint's `answer_limit` fields the body gives (max_completion_tokens,
      max_tokens; the Responses API's max_output_tokens), else `most_tokens` (the model's
      default: its context, which an engine fills when nothing stops it sooner). An endpoint
      that generates nothing (embeddings, a count of tokens) has no answer_limit: no answers.
    """
    if not answer_limit:
        return len(raw) + TEMPLATE_TOKENS
    most = next((body[name] for name in answer_limit if name in body), None)
    if not isinstance(most, int) or isinstance(most, bool) or most < 1:
        most = most_tokens
    return len(raw) + TEMPLATE_TOKENS + answers(body) * min(most, most_tokens)


def answers(body: dict[str, Any]) -> int:
    """How many answers a request asks for: n, for each of its prompts (a completion's prompt
    may be a list of them)."""
    n = body.get("n")
    count = n if isinstance(n, int) and n > 1 else 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        count *= len(prompt)
    return count


def key_tag(key_id: int) -> int:
    return key_id << 1


def team_tag(team_id: int) -> int:
    return team_id << 1 | 1


# -- budgets ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Base:
    """One key's or team's tokens in the database (KeyUsageDay) when the snapshot was read:
    all writers', and of those, each local live writer's own."""

    day: int = 0
    month: int = 0
    by_writer: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Budgets:
    """Tokens used today and this month (UTC), for keys and teams with a budget.

    The traffic book (access.traffic) of every gateway process writes each key's tokens per
    model and day as its own rows (`writer`), with the absolute totals it holds, every few
    seconds. A budget counts every writer once:

    - a writer that is a live gateway process of this machine counts by what it holds now in
      its limits file (its tokens since it started, the same figures its book writes), and not
      by its rows: the base leaves out its rows as they were at the read, so whatever it
      flushes after the read is not counted twice, and whatever it has not flushed is counted;
    - every other writer (another machine's process, a process gone) counts by its rows as the
      database held them at the read (`read_budgets`, with the snapshot: at least every 5 s).

    So a restart loses nothing the book wrote: a process's rows outlive it. What a process
    counted after its last flush is lost if it is killed (as its traffic figures are; a stop
    flushes first), and another machine's use is seen up to a snapshot read and a flush late.
    A team's use is that of the keys in it now.
    """

    day: date
    month: date  # its first day
    by_subject: dict[int, Base]

    def used(self, tag: int, local: dict[str, tuple[int, int]], today: date) -> tuple[int, int]:
        """Tokens today and this month: the base, plus what each local live writer (its
        tokens today and this month, `local`) counted beyond its rows in the base."""
        base = self.by_subject.get(tag, _NO_BASE)
        same_month = today.replace(day=1) == self.month
        day = base.day if today == self.day else 0
        month = base.month if same_month else 0
        for writer, (mine_day, mine_month) in local.items():
            written_day, written_month = base.by_writer.get(writer, (0, 0))
            day += max(0, mine_day - (written_day if today == self.day else 0))
            month += max(0, mine_month - (written_month if same_month else 0))
        return day, month


_NO_BASE = Base()


def no_budgets() -> Budgets:
    today = datetime.now(UTC).date()
    return Budgets(day=today, month=today.replace(day=1), by_subject={})


def read_budgets(local_writers: Iterable[str]) -> Budgets:
    """What the database holds of this month's tokens, for keys with a budget and keys of
    teams with one (see Budgets), in one query."""

    today = datetime.now(UTC).date()
    month = today.replace(day=1)
    writers = sorted(set(local_writers))
    local: Any = (
        Case(
            When(writer__in=writers, then=F("writer")), default=Value(""), output_field=CharField()
        )
        if writers
        else Value("", output_field=CharField())
    )
    rows = (
        KeyUsageDay.objects.order_by()
        .filter(day__gte=month)
        .filter(
            Q(key__tokens_per_day__isnull=False)
            | Q(key__tokens_per_month__isnull=False)
            | Q(key__team__tokens_per_day__isnull=False)
            | Q(key__team__tokens_per_month__isnull=False)
        )
        .annotate(
            local=local,
            today=Case(
                When(day=today, then=Value(1)), default=Value(0), output_field=IntegerField()
            ),
        )
        .values_list("key_id", "key__team_id", "local", "today")
        .annotate(tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
    )
    totals: dict[int, list[int]] = {}
    mine: dict[int, dict[str, list[int]]] = {}
    for key_id, team_id, writer, is_today, tokens in rows:
        tokens = int(tokens or 0)
        for tag in (key_tag(key_id), *(() if team_id is None else (team_tag(team_id),))):
            total = totals.setdefault(tag, [0, 0])
            total[1] += tokens
            total[0] += tokens if is_today else 0
            if writer:
                own = mine.setdefault(tag, {}).setdefault(writer, [0, 0])
                own[1] += tokens
                own[0] += tokens if is_today else 0
    return Budgets(
        day=today,
        month=month,
        by_subject={
            tag: Base(
                day=day,
                month=month_tokens,
                by_writer={w: (d, m) for w, (d, m) in mine.get(tag, {}).items()},
            )
            for tag, (day, month_tokens) in totals.items()
        },
    )


# -- the decision ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OverLimit:
    """A limit's refusal of a request, as the limits decide it: which limit, whose, its figure
    and when it frees (gateway.errors.limited makes the 429 of it; core.refusals.Refused is the
    web's)."""

    # rpm | tpm | max_parallel | tokens_per_day | tokens_per_month | slots | redis (Redis
    # cannot be reached, and LLMGW_LIMITS_REDIS_FALLBACK is refuse)
    limit: str
    subject: str  # "key" | "team"
    team: str  # the team's name, for a team's limit
    figure: int
    used: int
    retry_after: float  # seconds
    headers: tuple[tuple[str, str], ...] = ()
    # Tokens held by requests in flight, beside `used` (a token limit's refusal).
    reserved: int = 0
    # "alone" when Redis could not be reached and this machine decided by its own counts.
    fallback: str = ""


@dataclass(slots=True)
class Admission:
    """A request let through: what it holds (its in-flight counts and reservations) and what
    its answers say."""

    slots: tuple[tuple[int, int], ...]  # (tag, own slot) of the key and its team
    headers: tuple[tuple[str, str], ...]
    # The counters it was counted in: given back there, even if this process's counters were
    # replaced meanwhile (tests do).
    counters: SharedCounters | None = None
    released: bool = False
    # What Redis counted of it, where several machines count together (gateway.redislimits).
    remote: Decided | None = None
    # The tokens it reserves against each of `slots` (0 where its subject limits no tokens).
    reserved: tuple[int, ...] = ()
    # "alone" when Redis could not be reached and this machine decided by its own counts.
    fallback: str = ""

    def release(self, tokens: int) -> None:
        if self.counters is not None:
            self.counters.release(self, tokens)


def reset_text(seconds: float) -> str:
    """A reset as OpenAI writes it in x-ratelimit-reset-*: 20ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    whole = int(seconds + 0.999)
    if whole < 60:
        return f"{whole}s"
    minutes, rest = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{rest}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{rest}s"


def _month_index(day: date) -> int:
    return day.year * 12 + day.month


def _next_midnight(now: float) -> float:
    today = datetime.fromtimestamp(now, UTC).date()
    return datetime.combine(today + timedelta(days=1), datetime.min.time(), UTC).timestamp()


def _next_month(now: float) -> float:
    today = datetime.fromtimestamp(now, UTC).date()
    first = date(today.year + today.month // 12, today.month % 12 + 1, 1)
    return datetime.combine(first, datetime.min.time(), UTC).timestamp()


@dataclass(slots=True)
class _Use:
    in_flight: int
    reserved: int  # tokens reserved by requests in flight
    requests: list[int]  # by bucket age: 0 = the current bucket
    tokens: list[int]
    local: dict[str, tuple[int, int]]  # writer -> (tokens today, this month), live ones


class SharedCounters:
    """This process's counts, in a file the other processes of this machine read, and the
    decision that reads them all.

    Each process writes its counts into its board under VAR_DIR/gateway-limits (gateway.boards:
    a file of its own, read by the others), and a check adds up every live process's. A check
    and the count it admits are made under one lock (flock on a file in the folder, held for
    microseconds), so two processes cannot both admit the last request a limit allows. A
    process that dies takes its board with it (removed by the next process that looks): what it
    had in flight stops counting at once, as the requests did. Requests in flight are one
    counter per key and team, up on admission, down when the request ends however it ends
    (gateway.relay's `finally`). A request limited in tokens holds its `reservation` in flight
    beside the tokens used, and settles to what it used when it ends."""

    def __init__(self, folder: Path, *, pid: int | None = None, writer: str = "") -> None:
        self.folder = folder
        self.pid = pid if pid is not None else os.getpid()
        folder.mkdir(parents=True, exist_ok=True)
        self._lock_handle = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        # The lock file holds the folder's generation: one more each time a process's file is
        # made or dropped, so a check reads one number, not the folder, to know it has them all.
        # Allocated, not sparse (gateway.boards.map_shared says why).
        allocate(self._lock_handle, 8)
        self._generation_map = mmap.mmap(self._lock_handle, 8)
        self._generation = memoryview(self._generation_map).cast("q")
        self.board = boards.Board(folder, FILE_PREFIX, BOARD_BYTES, layout=LAYOUT, fmt="q", pid=pid)
        self._mine = self.board.body
        self._writer = ""
        self.set_writer(writer)
        self._slots: dict[int, int] = {}  # tag -> own slot
        self._seen_generation = -1
        self._calendar = (-1, date.min, 0, 0)  # bucket -> (today, its ordinal, month index)
        self._bump_generation()
        self.closed = False
        # Where several machines count together (REDIS_URL): set by the gateway's start.
        self.remote: RedisLimits | None = None

    # -- this process's file ---------------------------------------------------------------

    def set_writer(self, writer: str) -> None:
        """The traffic book's writer name whose rows this process's tokens are (Budgets)."""
        if writer == self._writer:
            return
        raw = writer.encode()[:WRITER_BYTES]
        self._mine[1 : 1 + WRITER_BYTES // 8] = memoryview(raw.ljust(WRITER_BYTES, b"\0")).cast("q")
        self._mine[0] = len(raw)
        self._writer = writer

    def held(self) -> int:
        """Slots this process holds (for llmgw_gateway_limit_slots_held)."""
        return len(self._slots)

    def _own_slot(self, tag: int, bucket: int, month: int) -> int | None:
        slot = self._slots.get(tag)
        if slot is not None:
            return slot
        view = self._mine
        home = zlib.crc32(tag.to_bytes(8, "little")) % SLOTS
        reusable = None
        for step in range(PROBE):
            slot = (home + step) % SLOTS
            base = HEADER + slot * WIDTH
            held_by = view[base + TAG]
            if held_by == 0:
                break
            if reusable is None and _idle(view, base, bucket, month):
                reusable = slot
        else:
            slot = None
        if reusable is not None:
            slot = reusable
        if slot is None:
            return None
        base = HEADER + slot * WIDTH
        previous = view[base + TAG]
        if previous:
            self._slots.pop(previous, None)
        # Zeroed before it is tagged: a reader that sees the new tag sees no old counts.
        for index in range(1, WIDTH):
            view[base + index] = 0
        view[base + TAG] = tag
        self._slots[tag] = slot
        return slot

    # -- everyone's files ------------------------------------------------------------------

    def _bump_generation(self) -> None:
        fcntl.flock(self._lock_handle, fcntl.LOCK_EX)
        try:
            self._generation[0] += 1
        finally:
            fcntl.flock(self._lock_handle, fcntl.LOCK_UN)

    def _rescan(self, now: float) -> None:
        generation = self._generation[0]
        changed, self._seen_generation = generation != self._seen_generation, generation
        if self.board.rescan(now, force=changed):
            self._generation[0] += 1  # files removed; under the lock: a check rescans under it

    def _views(self) -> Iterable[memoryview]:
        yield self._mine
        for other in self.board.others.values():
            yield other.body

    def _use(self, tag: int, bucket: int, day: int, month: int, *, local: bool = True) -> _Use:
        """What every live process counted for `tag`; with `local`, also each writer's tokens
        today and this month (what a budget needs)."""
        use = _Use(0, 0, [0] * BUCKETS, [0] * BUCKETS, {})
        requests, tokens = use.requests, use.tokens
        home = zlib.crc32(tag.to_bytes(8, "little")) % SLOTS
        for view in self._views():
            base = _find(view, tag, home)
            if base is None:
                continue
            row = view[base : base + WIDTH].tolist()  # one copy in C, then plain ints
            use.in_flight += row[IN_FLIGHT]
            use.reserved += row[RESERVED]
            for stamp, asked, used in zip(
                row[STAMPS:REQUESTS], row[REQUESTS:TOKENS], row[TOKENS:WIDTH], strict=True
            ):
                age = bucket - stamp
                if 0 <= age < BUCKETS:
                    requests[age] += asked
                    tokens[age] += used
            writer = (self._writer if view is self._mine else _writer_in(view)) if local else ""
            if writer:
                day_tokens = row[DAY_TOKENS] if row[DAY] == day else 0
                month_tokens = row[MONTH_TOKENS] if row[MONTH] == month else 0
                had = use.local.get(writer, (0, 0))
                use.local[writer] = (had[0] + day_tokens, had[1] + month_tokens)
        return use

    def writers(self) -> list[str]:
        """The traffic-book writers of this machine's live gateway processes (from any thread)."""
        names = [self._writer] if self._writer else []
        with _boards_in(self.folder, skip=self.pid) as found:
            names += [name for other in found if (name := _writer_in(other.body))]
        return names

    # -- the decision ----------------------------------------------------------------------

    async def check(
        self,
        key_id: int,
        key: Limits,
        team: Limits | None,
        budgets: Budgets,
        *,
        reserve: int = 0,
    ) -> Admission | OverLimit:
        """`admit`, over every machine first where Redis counts: one round trip, awaited (the
        event loop serves other requests meanwhile), which counts the request when it goes.
        When Redis cannot be reached, LLMGW_LIMITS_REDIS_FALLBACK decides: this machine's own
        counts (alone), or a refusal (refuse) for a request Redis would have counted."""
        remote = self.remote
        if remote is None:
            return self.admit(key_id, key, team, budgets, reserve=reserve)
        now = time.time()
        rated = self._rated(key_id, key, team)
        if not rated:
            return self.admit(key_id, key, team, budgets, now, reserve=reserve)
        decided = await remote.admit(
            [
                (lim.ident, lim.max_parallel, lim.rpm, lim.tpm, reserve if lim.tokened else 0)
                for _, lim, _ in rated
            ],
            int(now // BUCKET_SECONDS),
        )
        if decided is None:
            if remote.fallback == "refuse":
                _, limits, whose = rated[0]
                return OverLimit("redis", whose, limits.name, 0, 0, remote.down_for())
            done = self.admit(key_id, key, team, budgets, now, reserve=reserve)
            if isinstance(done, Admission):
                done.fallback = "alone"
                return done
            return replace(done, fallback="alone")
        return self.admit(key_id, key, team, budgets, now, reserve=reserve, decided=decided)

    def _subjects(
        self, key_id: int, key: Limits, team: Limits | None
    ) -> list[tuple[int, Limits, str]]:
        """(tag, limits, whose) of the key and its team, where they count anything."""
        subjects: list[tuple[int, Limits, str]] = []
        if key.counted:
            subjects.append((key_tag(key_id), key, "key"))
        if team is not None and team.counted and key.team_id is not None:
            subjects.append((team_tag(key.team_id), team, "team"))
        return subjects

    def _rated(
        self, key_id: int, key: Limits, team: Limits | None
    ) -> list[tuple[int, Limits, str]]:
        """The subjects Redis counts: those with a per-minute or in-flight limit."""
        return [s for s in self._subjects(key_id, key, team) if s[1].rated and s[1].ident]

    def admit(
        self,
        key_id: int,
        key: Limits,
        team: Limits | None,
        budgets: Budgets,
        now: float | None = None,
        *,
        reserve: int = 0,
        decided: Decided | None = None,
    ) -> Admission | OverLimit:
        """Let one request through (counting it, and reserving `reserve` tokens against its
        token limits) or say which limit refuses it. `decided`: what Redis decided of it over
        every machine (see check); this machine's counts also hold the budgets."""
        now = time.time() if now is None else now
        bucket = int(now // BUCKET_SECONDS)
        today, day, month = self._day_of(bucket, now)
        subjects = self._subjects(key_id, key, team)
        wider: dict[int, Counted] = {}
        if decided is not None:
            rated = (tag for tag, _, _ in self._rated(key_id, key, team))
            wider = dict(zip(rated, decided.counted, strict=True))
        # Without the lock first. Each process admits one request at a time (its event loop),
        # so what a check cannot see is at most one admission under way in each other
        # process: where every count is at least that many below its limit (and every token
        # limit that many reservations like this one), the request goes without the lock, and
        # the limits stay exact. Otherwise, and when the folder's files changed, the check is
        # made again under the lock.
        monotonic = time.monotonic()
        if self._generation[0] == self._seen_generation and not self.board.due(monotonic):
            done = self._decide(subjects, bucket, day, month, today, now, budgets, wider,
                                reserve, slack=len(self.board.others))  # fmt: skip
            if done is not None:
                return self._decided(done, decided, bucket)
        fcntl.flock(self._lock_handle, fcntl.LOCK_EX)
        try:
            self._rescan(monotonic)
            done = self._decide(subjects, bucket, day, month, today, now, budgets, wider,
                                reserve, slack=0)  # fmt: skip
            assert done is not None  # with no slack, every check is sure
        finally:
            fcntl.flock(self._lock_handle, fcntl.LOCK_UN)
        return self._decided(done, decided, bucket)

    def _decide(
        self,
        subjects: list[tuple[int, Limits, str]],
        bucket: int,
        day: int,
        month: int,
        today: date,
        now: float,
        budgets: Budgets,
        wider: dict[int, Counted],
        reserve: int,
        *,
        slack: int,
    ) -> Admission | OverLimit | None:
        """Check (and, when it goes, count) a request: None when a count is within `slack` of
        its limit (see admit)."""
        headers: dict[str, tuple[int, int, float]] = {}
        slots = []
        reserved = []
        for tag, limits, whose in subjects:
            use = self._use(tag, bucket, day, month, local=limits.budgeted)
            mine = reserve if limits.tokened else 0
            if tag in wider:
                _count_wider(use, wider[tag])  # decided in Redis, in one step: no slack
                refused = _refusal(limits, whose, use, budgets, tag, today, now, headers, 0, mine)
            else:
                refused = _refusal(limits, whose, use, budgets, tag, today, now, headers, slack,
                                   mine)  # fmt: skip
            if refused is _UNSURE:
                return None
            if refused is not None:
                return refused
            slot = self._own_slot(tag, bucket, month)
            if slot is None:
                return OverLimit("slots", whose, limits.name, SLOTS, SLOTS, 1.0)
            slots.append((tag, slot))
            reserved.append(mine)
        for (_, slot), mine in zip(slots, reserved, strict=True):
            base = HEADER + slot * WIDTH
            self._mine[base + IN_FLIGHT] += 1
            self._mine[base + RESERVED] += mine
            self._add(base, REQUESTS, bucket, 1)
        return Admission(tuple(slots), _headers(headers), self, reserved=tuple(reserved))

    def _decided(
        self, done: Admission | OverLimit, decided: Decided | None, bucket: int
    ) -> Admission | OverLimit:
        if isinstance(done, OverLimit):
            if self.remote is not None and decided is not None:
                self.remote.end(decided, 0, bucket, taken_back=True)
            return done
        done.remote = decided
        return done

    def _day_of(self, bucket: int, now: float) -> tuple[date, int, int]:
        """The UTC day of `now`, its ordinal and its month's index, kept for the 5-second bucket
        (a bucket never spans midnight: a day is a whole number of buckets)."""
        calendar = self._calendar
        if calendar[0] != bucket:
            today = datetime.fromtimestamp(now, UTC).date()
            calendar = self._calendar = (bucket, today, today.toordinal(), _month_index(today))
        return calendar[1], calendar[2], calendar[3]

    def peek(
        self, key_id: int, key: Limits, team: Limits | None, now: float | None = None
    ) -> tuple[tuple[str, str], ...]:
        """The x-ratelimit-* headers for a request that counted nothing (refused before its
        limits were checked: a bad body, an unknown model). Reads only, without the lock."""
        now = time.time() if now is None else now
        bucket = int(now // BUCKET_SECONDS)
        into_bucket = now % BUCKET_SECONDS
        headers: dict[str, tuple[int, int, float]] = {}
        self._rescan(time.monotonic())
        for tag, limits in ((key_tag(key_id), key), (team_tag(key.team_id or 0), team)):
            if limits is None or (limits.rpm is None and limits.tpm is None):
                continue
            use = self._use(tag, bucket, 0, 0)
            for kind, limit, by_age, held in (
                ("requests", limits.rpm, use.requests, 0),
                ("tokens", limits.tpm, use.tokens, use.reserved),
            ):
                if limit is None:
                    continue
                youngest = next((age for age in range(BUCKETS) if by_age[age]), None)
                reset = 0.0 if youngest is None else (BUCKETS - youngest) * BUCKET_SECONDS
                left = limit - sum(by_age) - held
                _tighter(headers, kind, (limit, left, max(0.0, reset - into_bucket)))
        return _headers(headers)

    def release(self, admission: Admission, tokens: int, now: float | None = None) -> None:
        """The request ended (however): it is no longer in flight, its tokens count, and what
        it reserved is given back.

        Only this process writes its file, and only lower (in flight) or what a check is
        already allowed to lag by (tokens), so no lock is taken. Its tokens are counted before
        its reservation goes: a check between the two sees both, and refuses early at worst."""
        if admission.released or self.closed:
            return
        admission.released = True
        now = time.time() if now is None else now
        bucket = int(now // BUCKET_SECONDS)
        if admission.remote is not None and self.remote is not None:
            self.remote.end(admission.remote, tokens, bucket)
        _, day, month = self._day_of(bucket, now)
        view = self._mine
        reserved = admission.reserved or (0,) * len(admission.slots)
        for (tag, slot), mine in zip(admission.slots, reserved, strict=True):
            base = HEADER + slot * WIDTH
            if view[base + TAG] != tag:
                continue
            view[base + IN_FLIGHT] = max(0, view[base + IN_FLIGHT] - 1)
            if tokens:
                self._add(base, TOKENS, bucket, tokens)
                if view[base + DAY] != day:
                    view[base + DAY_TOKENS] = 0
                    view[base + DAY] = day
                view[base + DAY_TOKENS] += tokens
                if view[base + MONTH] != month:
                    view[base + MONTH_TOKENS] = 0
                    view[base + MONTH] = month
                view[base + MONTH_TOKENS] += tokens
            if mine:
                view[base + RESERVED] = max(0, view[base + RESERVED] - mine)

    def _add(self, base: int, column: int, bucket: int, amount: int) -> None:
        view = self._mine
        index = bucket % BUCKETS
        if view[base + STAMPS + index] != bucket:
            # The bucket held a minute-old count: start it over.
            view[base + REQUESTS + index] = 0
            view[base + TOKENS + index] = 0
            view[base + STAMPS + index] = bucket
        view[base + column + index] += amount

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.remote is not None:
            self.remote.close()
        self.board.close()
        self._bump_generation()
        self._generation.release()
        self._generation_map.close()
        os.close(self._lock_handle)


def _count_wider(use: _Use, counted: Counted) -> None:
    """A subject's rates as every machine counts them (Redis), in place of this machine's: its
    requests in flight and per minute, and the tokens reserved (Redis counted this machine's
    too)."""
    use.in_flight = counted.in_flight
    use.reserved = counted.reserved
    use.requests = list(counted.requests)
    use.tokens = list(counted.tokens)


def _idle(view: memoryview, base: int, bucket: int, month: int) -> bool:
    if view[base + IN_FLIGHT]:
        return False
    if view[base + MONTH] == month and view[base + MONTH_TOKENS]:
        return False
    return all(bucket - view[base + STAMPS + i] >= BUCKETS for i in range(BUCKETS))


def _find(view: memoryview, tag: int, home: int) -> int | None:
    """Where `tag` is counted in a file (its offset), or None."""
    for step in range(PROBE):
        base = HEADER + ((home + step) % SLOTS) * WIDTH
        held_by = view[base + TAG]
        if held_by == tag:
            return base
        if held_by == 0:
            return None
    return None


def _refusal(
    limits: Limits,
    whose: str,
    use: _Use,
    budgets: Budgets,
    tag: int,
    today: date,
    now: float,
    headers: dict[str, tuple[int, int, float]],
    slack: int = 0,
    reserve: int = 0,
) -> OverLimit | None:
    """The refusal of the first limit the request would pass, or None; _UNSURE where a count of
    requests is below its limit by no more than `slack`, or tokens by no more than `slack` + 1
    reservations of `reserve` (admissions other processes may have under way unseen: see
    SharedCounters.admit)."""
    team = limits.name if whose == "team" else ""
    into_bucket = now % BUCKET_SECONDS

    if limits.max_parallel is not None and use.in_flight >= limits.max_parallel:
        return _parallel_refusal(limits, whose, team, use, into_bucket)
    if limits.max_parallel is not None and use.in_flight + slack >= limits.max_parallel:
        return _UNSURE
    if limits.rpm is not None:
        used = sum(use.requests)
        if used < limits.rpm <= used + slack:
            return _UNSURE
        if used >= limits.rpm:
            wait = _frees_in(use.requests, used - limits.rpm + 1, into_bucket)
            shown = ((limits.rpm, 0, wait),)
            return OverLimit(
                "rpm", whose, team, limits.rpm, used, wait, _headers({"requests": shown[0]})
            )
        # As OpenAI means it: until the window is back to empty, this request included.
        reset = BUCKETS * BUCKET_SECONDS - into_bucket
        _tighter(headers, "requests", (limits.rpm, limits.rpm - used - 1, reset))
    held = use.reserved  # tokens reserved by requests in flight, this one not counted
    if limits.tpm is not None:
        used = sum(use.tokens)
        if slack and used + held < limits.tpm < used + held + (slack + 1) * reserve:
            return _UNSURE
        if used + held >= limits.tpm:
            # Past the limit by what was used: until enough has left the window; else by what
            # requests in flight reserve: until one of them ends.
            wait = (
                _frees_in(use.tokens, used - limits.tpm + 1, into_bucket)
                if used >= limits.tpm
                else 1.0
            )
            return OverLimit(
                "tpm",
                whose,
                team,
                limits.tpm,
                used,
                wait,
                _headers({"tokens": (limits.tpm, 0, wait)}),
                reserved=held,
            )
        # Until the newest tokens counted have left the window (this request's come later).
        reset = _frees_in(use.tokens, used, into_bucket) if used else 0.0
        _tighter(headers, "tokens", (limits.tpm, limits.tpm - used - held, reset))
    if limits.budgeted:
        day_used, month_used = budgets.used(tag, use.local, today)
        for budget, figure, used, resets_in in (
            ("tokens_per_day", limits.tokens_per_day, day_used, _next_midnight(now) - now),
            ("tokens_per_month", limits.tokens_per_month, month_used, _next_month(now) - now),
        ):
            if figure is None:
                continue
            if slack and used + held < figure < used + held + (slack + 1) * reserve:
                return _UNSURE
            if used + held >= figure:
                wait = resets_in if used >= figure else 1.0
                return OverLimit(budget, whose, team, figure, used, wait, reserved=held)
    return None


def _parallel_refusal(
    limits: Limits, whose: str, team: str, use: _Use, into_bucket: float
) -> OverLimit:
    """Refused for its requests in flight, with where its per-minute limits stand (this
    request not counted: it is not)."""
    standing: dict[str, tuple[int, int, float]] = {}
    for kind, limit, by_age in (
        ("requests", limits.rpm, use.requests),
        ("tokens", limits.tpm, use.tokens),
    ):
        if limit is not None:
            used = sum(by_age)
            reset = _frees_in(by_age, used, into_bucket) if used else 0.0
            standing[kind] = (limit, limit - used, reset)
    max_parallel = limits.max_parallel or 0
    return OverLimit(
        "max_parallel", whose, team, max_parallel, use.in_flight, 1.0, _headers(standing)
    )


# _refusal's answer where only the lock can decide.
_UNSURE = OverLimit("", "", "", 0, 0, 0.0)


def _frees_in(by_age: list[int], enough: int, into_bucket: float) -> float:
    """Seconds until `enough` of what the window counts (by bucket age) has left it."""
    left = 0
    for age in range(BUCKETS - 1, -1, -1):
        left += by_age[age]
        if left >= enough:
            return (BUCKETS - age) * BUCKET_SECONDS - into_bucket
    return BUCKETS * BUCKET_SECONDS - into_bucket


def _tighter(
    headers: dict[str, tuple[int, int, float]], kind: str, figures: tuple[int, int, float]
) -> None:
    """The key's and the team's limits both apply: the headers show the one nearer its end."""
    held = headers.get(kind)
    if held is None or figures[1] < held[1]:
        headers[kind] = figures


def _headers(figures: dict[str, tuple[int, int, float]]) -> tuple[tuple[str, str], ...]:
    out = []
    for kind in ("requests", "tokens"):
        if kind in figures:
            limit, remaining, reset = figures[kind]
            out += [
                (f"x-ratelimit-limit-{kind}", str(limit)),
                (f"x-ratelimit-remaining-{kind}", str(max(0, remaining))),
                (f"x-ratelimit-reset-{kind}", reset_text(reset)),
            ]
    return tuple(out)


def _writer_in(view: memoryview) -> str:
    """The traffic book's writer whose rows a board's tokens are ("" where it names none)."""
    length = view[0]
    if not 0 < length <= WRITER_BYTES:
        return ""
    return view[1 : 1 + WRITER_BYTES // 8].tobytes()[:length].decode(errors="replace")


def _boards_in(
    folder: Path, skip: int = -1
) -> contextlib.AbstractContextManager[list[boards.Other]]:
    """Every live process's board under `folder` (but `skip`'s), mapped while the block runs:
    read without the lock, from any thread."""
    return boards.reading(folder, FILE_PREFIX, BOARD_BYTES, layout=LAYOUT, fmt="q", skip=skip)


# -- what the web shows: use now, read from the gateway processes' files ----------------------


def live_use(
    keys: Iterable[Any] = (), teams: Iterable[Any] = (), *, folder: Path | None = None
) -> dict[tuple[str, int], LiveUse]:
    """The use now of each of `keys` (GatewayKey rows) and `teams` (Team rows), by
    ("key", id) and ("team", id): requests in flight, and requests and tokens in the last
    minute (the window the limits count, 60 to 65 s): over every machine as Redis counts them
    where it does (gateway.redislimits), else as the gateway processes of this machine count
    them. Keys and teams with no counted limit are not counted anywhere: theirs are 0.
    Reads the files only (no lock): a figure can be a request behind."""

    keys, teams = list(keys), list(teams)
    bucket = int(time.time() // BUCKET_SECONDS)
    url = conf.limits_redis_url()
    if url and (keys or teams):
        idents = {key_ident(k.key_hash): ("key", k.id) for k in keys}
        idents.update({team_ident(t.id, t.created_at): ("team", t.id) for t in teams})
        try:
            counted = read_use(url, list(idents), bucket)
        except Exception:  # Redis down: this machine's own counts, below
            log.warning("limits: Redis cannot be reached; showing this machine's counts")
        else:
            return {idents[ident]: LiveUse(*figures) for ident, figures in counted.items()}
    if folder is None:
        folder = settings.VAR_DIR / "gateway-limits"
    wanted = {key_tag(k.id): ("key", k.id) for k in keys}
    wanted.update({team_tag(t.id): ("team", t.id) for t in teams})
    found = {subject: LiveUse() for subject in wanted.values()}
    if not wanted or not folder.is_dir():
        return found
    totals = {tag: [0, 0, 0] for tag in wanted}
    with _boards_in(folder) as files:
        for view in (other.body for other in files):
            for tag, total in totals.items():
                base = _find(view, tag, zlib.crc32(tag.to_bytes(8, "little")) % SLOTS)
                if base is None:
                    continue
                total[0] += view[base + IN_FLIGHT]
                for index in range(BUCKETS):
                    if 0 <= bucket - view[base + STAMPS + index] < BUCKETS:
                        total[1] += view[base + REQUESTS + index]
                        total[2] += view[base + TOKENS + index]
    for tag, (in_flight, requests, tokens) in totals.items():
        found[wanted[tag]] = LiveUse(in_flight, requests, tokens)
    return found
