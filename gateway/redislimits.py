"""Keys' and teams' rate limits across several gateway machines, counted in Redis.

gateway.limits counts exactly across the gateway processes of one machine. With REDIS_URL set
(and LLMGW_LIMITS_REDIS not "off"), a key or team with a requests-per-minute, tokens-per-minute
or in-flight limit is also counted in Redis, where every machine's gateway processes count
together: admission is one round trip to a script (_ADMIT) that decides and counts atomically,
awaited on the event loop; a request's end is written off its path (_END). When Redis cannot
be reached, LLMGW_LIMITS_REDIS_FALLBACK decides. How it counts, and what it allows:
docs/sharing.md#over-several-machines; an outage: docs/gateway.md#when-redis-is-slow-or-away.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import secrets
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.connection

from . import conf

log = logging.getLogger("llmgw.gateway")

# One hash per key or team in use (KEY_PREFIX + its ident: two fields per 5-second bucket of the
# last 65 s, one per process with requests in flight), and for one limited in tokens another
# (RESERVED_PREFIX: one field per process with requests in flight), each dropped KEEP_SECONDS
# after its last request.
KEY_PREFIX = "llmgw:limits:"
RESERVED_PREFIX = "llmgw:limits-reserved:"
# Each process counts its requests in flight and reservations under a name of its own (holder),
# kept alive as HOLDER_PREFIX + name for HOLDER_SECONDS, renewed every HEARTBEAT_SECONDS by the
# flush thread. A process that dies stops holding its requests when its name expires; until
# then they still count, which refuses early, never lets more through.
HOLDER_PREFIX = "llmgw:limits-holder:"
# Redis unreachable (refused, or no answer within LLMGW_LIMITS_REDIS_TIMEOUT): not asked again
# for this long, the fallback deciding meanwhile.
DOWN_SECONDS = 5.0
# Requests' ends are queued and written by a thread this often, in one pipeline for all that
# ended: another machine sees an end that much (plus a round trip) late, which can only refuse
# early. At most MAX_PENDING wait; past it the oldest are dropped (and counted), each leaving a
# request counted in flight until its process's name expires.
FLUSH_SECONDS = 0.05
HEARTBEAT_SECONDS = 5.0
HOLDER_SECONDS = 20
KEEP_SECONDS = 3600
MAX_PENDING = 100_000
BUCKETS = 13  # as gateway.limits: 5-second buckets, a minute and one bucket
# How long a connection whose admission timed out waits for its late answers before it closes.
LATE_SECONDS = 5.0

# KEYS: one hash per subject, then one per subject of the tokens reserved by each process (a
# hash of its own, which a gateway of an earlier version, counting in the same Redis during an
# upgrade, never reads). ARGV: the bucket now, this process's name, the holders' prefix, then
# per subject its in-flight, requests-per-minute and tokens-per-minute limits (-1: none) and the
# tokens the request reserves, then how long the hashes are kept.
# Answers: the first subject (1-based) whose limit refuses the request (0: it was counted),
# then per subject its in-flight count, its tokens reserved, and its requests and tokens by
# bucket age (13 each).
_ADMIT = """
local bucket = tonumber(ARGV[1])
local holder = ARGV[2]
local holders = ARGV[3]
local subjects = #KEYS / 2
local answer = {0}
local refused = 0
local alive = {}
local function live(name)
  if alive[name] == nil then
    alive[name] = name == holder or redis.call('EXISTS', holders .. name) == 1
  end
  return alive[name]
end
for i = 1, subjects do
  local parallel = tonumber(ARGV[4 * i])
  local rpm = tonumber(ARGV[1 + 4 * i])
  local tpm = tonumber(ARGV[2 + 4 * i])
  local fields = redis.call('HGETALL', KEYS[i])
  local in_flight, reserved, requests, tokens = 0, 0, {}, {}
  for age = 1, 13 do requests[age] = 0; tokens[age] = 0 end
  for j = 1, #fields, 2 do
    local name, value = fields[j], tonumber(fields[j + 1])
    local kind, rest = string.sub(name, 1, 1), string.sub(name, 3)
    if kind == 'f' then
      if live(rest) then
        in_flight = in_flight + value
      else
        redis.call('HDEL', KEYS[i], name)
      end
    else
      local age = bucket - tonumber(rest)
      if age >= 13 then
        redis.call('HDEL', KEYS[i], name)
      elseif age >= 0 then
        if kind == 'r' then
          requests[age + 1] = requests[age + 1] + value
        else
          tokens[age + 1] = tokens[age + 1] + value
        end
      end
    end
  end
  local held = redis.call('HGETALL', KEYS[subjects + i])
  for j = 1, #held, 2 do
    if live(held[j]) then
      reserved = reserved + tonumber(held[j + 1])
    else
      redis.call('HDEL', KEYS[subjects + i], held[j])
    end
  end
  local asked, used = 0, 0
  for age = 1, 13 do asked = asked + requests[age]; used = used + tokens[age] end
  if refused == 0 and ((parallel >= 0 and in_flight >= parallel) or (rpm >= 0 and asked >= rpm)
      or (tpm >= 0 and used + reserved >= tpm)) then
    refused = i
  end
  answer[#answer + 1] = in_flight
  answer[#answer + 1] = reserved
  for age = 1, 13 do answer[#answer + 1] = requests[age] end
  for age = 1, 13 do answer[#answer + 1] = tokens[age] end
end
answer[1] = refused
if refused == 0 then
  local keep = tonumber(ARGV[#ARGV])
  for i = 1, subjects do
    redis.call('HINCRBY', KEYS[i], 'r:' .. bucket, 1)
    redis.call('HINCRBY', KEYS[i], 'f:' .. holder, 1)
    redis.call('EXPIRE', KEYS[i], keep)
    local reserve = tonumber(ARGV[3 + 4 * i])
    if reserve > 0 then
      redis.call('HINCRBY', KEYS[subjects + i], holder, reserve)
      redis.call('EXPIRE', KEYS[subjects + i], keep)
    end
  end
end
return answer
"""

# KEYS: as _ADMIT's. ARGV: this process's name, the bucket, tokens, requests to take back (1
# when a request counted here was refused by a limit only the machine knows), then per subject
# the tokens it reserved.
_END = """
local subjects = #KEYS / 2
for i = 1, subjects do
  local left = redis.call('HINCRBY', KEYS[i], 'f:' .. ARGV[1], -1)
  if left <= 0 then redis.call('HDEL', KEYS[i], 'f:' .. ARGV[1]) end
  local reserved = tonumber(ARGV[4 + i])
  if reserved > 0 then
    local held = redis.call('HINCRBY', KEYS[subjects + i], ARGV[1], -reserved)
    if held <= 0 then redis.call('HDEL', KEYS[subjects + i], ARGV[1]) end
  end
  if tonumber(ARGV[3]) > 0 then redis.call('HINCRBY', KEYS[i], 't:' .. ARGV[2], ARGV[3]) end
  if tonumber(ARGV[4]) > 0 then
    local kept = redis.call('HINCRBY', KEYS[i], 'r:' .. ARGV[2], -tonumber(ARGV[4]))
    if kept <= 0 then redis.call('HDEL', KEYS[i], 'r:' .. ARGV[2]) end
  end
end
return 0
"""

FALLBACKS = ("alone", "refuse")


@dataclass(frozen=True, slots=True)
class Counted:
    """One subject's counts over every machine, before this request: in flight, the tokens
    reserved by requests in flight, and requests and tokens by the age of their 5-second
    bucket (0: the current one)."""

    in_flight: int
    requests: list[int]
    tokens: list[int]
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class Decided:
    """What Redis decided for a request: its subjects' counts, and whether it was counted (with
    the tokens it reserved against each)."""

    counted: tuple[Counted, ...]
    admitted: bool
    idents: tuple[str, ...]
    bucket: int
    reserved: tuple[int, ...] = ()


Pending = tuple[tuple[str, ...], int, int, int, tuple[int, ...]]


class RedisLimits:
    """This process's connection to the limits kept in Redis: admissions awaited on the event
    loop (only the requests that wait for Redis's word wait, LLMGW_LIMITS_REDIS_TIMEOUT at most),
    requests' ends and its holder's name written by a thread of its own. Each failure is counted
    in llmgw_gateway_limits_redis_errors_total, each request the fallback decided in
    llmgw_gateway_limits_redis_fallback_total{fallback}; llmgw_gateway_limits_redis_down is 1
    while the fallback decides, and an outage is logged when it begins and when it ends."""

    def __init__(
        self,
        url: str,
        *,
        on_error: Callable[[], None] | None = None,
        on_drop: Callable[[], None] | None = None,
        on_down: Callable[[bool], None] | None = None,
        timeout: float | None = None,
        fallback: str | None = None,
    ) -> None:
        self.url = url
        self.timeout = conf.limits_redis_timeout() if timeout is None else timeout
        self.fallback = conf.limits_redis_fallback() if fallback is None else fallback
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, not {self.fallback!r}")
        # The thread's client (the ends, the heartbeat): blocking, off the event loop, where a
        # slow answer holds up no request (it may take LATE_SECONDS).
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=max(self.timeout, LATE_SECONDS),
            socket_connect_timeout=self.timeout,
            health_check_interval=0,
        )
        self._errors = (redis.RedisError, OSError)
        self._end = self._redis.register_script(_END)
        # The event loop's connection (admissions), made on the loop that first admits.
        self._connections: dict[asyncio.AbstractEventLoop, _Connection] = {}
        self._opening: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self.holder = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._pending: deque[Pending] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._down_until = 0.0
        self._outage_logged = False
        self._on_error = on_error or (lambda: None)
        self._on_drop = on_drop or (lambda: None)
        self._on_down = on_down or (lambda down: None)
        self._thread = threading.Thread(target=self._run, name="llmgw-limits-redis", daemon=True)
        self._beat_at = 0.0
        self._heartbeat()
        self._thread.start()

    # -- the request's path ----------------------------------------------------------------

    async def _connection(self) -> _Connection:
        """This event loop's connection to Redis, made again when it was lost or left (one a
        loop: a test may run several)."""
        loop = asyncio.get_running_loop()
        held = self._connections.get(loop)
        if held is not None and held.usable:
            return held
        if self._opening is None or self._opening[0] is not loop:
            self._opening = (loop, asyncio.Lock())
        async with self._opening[1]:  # one admission connects, the others wait for it
            held = self._connections.get(loop)
            if held is None or not held.usable:
                held = await _Connection.open(self.url, loop)
                self._connections = {loop: held}  # a test's earlier loops are gone
        return held

    async def admit(
        self, subjects: Sequence[tuple[str, int | None, int | None, int | None, int]], bucket: int
    ) -> Decided | None:
        """Decide and count one request in one round trip, awaited: `subjects` are (ident,
        max_parallel, rpm, tpm, tokens to reserve). None when Redis cannot be reached within
        the timeout (or was not, less than DOWN_SECONDS ago): the fallback decides."""
        if not subjects or self.down:
            return None
        args: list[Any] = [bucket, self.holder, HOLDER_PREFIX]
        for _, parallel, rpm, tpm, reserve in subjects:
            args += [_or_none(parallel), _or_none(rpm), _or_none(tpm), max(0, reserve)]
        args.append(KEEP_SECONDS)
        idents = tuple(ident for ident, *_ in subjects)
        reserved = tuple(max(0, reserve) for *_, reserve in subjects)
        connection: _Connection | None = None
        call: asyncio.Future[Any] | None = None
        try:
            async with asyncio.timeout(self.timeout):
                connection = await self._connection()
                call = connection.script(_ADMIT, _keys(idents), args)
                # Shielded: an answer that comes after the timeout is still read, and what the
                # script counted then is given back (the fallback decided the request).
                answer = await asyncio.shield(call)
        except (*self._errors, TimeoutError) as error:
            if connection is not None and call is not None and not call.done():
                call.add_done_callback(lambda late: self._late(late, idents, bucket, reserved))
                # New admissions go on a new connection; this one waits for its late answers.
                connection.leave(LATE_SECONDS)
            self._failed(error)
            return None
        self._reached()
        return _decided(answer, idents, bucket, reserved)

    def _late(
        self,
        call: asyncio.Future[Any],
        idents: tuple[str, ...],
        bucket: int,
        reserved: tuple[int, ...],
    ) -> None:
        """An admission's answer after its timeout: what it counted is given back."""
        if call.cancelled() or call.exception() is not None:
            return
        self.end(_decided(call.result(), idents, bucket, reserved), 0, bucket, taken_back=True)

    @property
    def down(self) -> bool:
        """Whether Redis was found unreachable less than DOWN_SECONDS ago (the fallback
        decides meanwhile)."""
        return time.monotonic() < self._down_until

    def down_for(self) -> float:
        """Seconds until Redis is asked again (at least 1: a Retry-After)."""
        return max(1.0, self._down_until - time.monotonic())

    def end(self, decided: Decided, tokens: int, bucket: int, *, taken_back: bool = False) -> None:
        """A request counted here ended (or, `taken_back`, was refused after all): written
        with the next flush, off the request's path."""
        if not decided.admitted:
            return
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
            self._on_drop()
        reserved = decided.reserved or (0,) * len(decided.idents)
        self._pending.append((decided.idents, bucket, max(0, tokens), int(taken_back), reserved))

    # -- the thread: ends written, this process's name kept alive ----------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(FLUSH_SECONDS)
            self._wake.clear()
            if self.down:
                continue
            self.flush()
            if time.monotonic() - self._beat_at >= HEARTBEAT_SECONDS:
                self._heartbeat()

    def flush(self) -> None:
        """Write every queued end, in one pipeline (kept queued if Redis cannot be reached)."""
        if not self._pending:
            return
        batch: list[Pending] = []
        while self._pending and len(batch) < 1000:
            batch.append(self._pending.popleft())
        pipe = self._redis.pipeline(transaction=False)
        for idents, bucket, tokens, taken_back, reserved in batch:
            self._end(
                keys=_keys(idents),
                args=[self.holder, bucket, tokens, taken_back, *reserved],
                client=pipe,
            )
        try:
            pipe.execute()
        except self._errors as error:
            self._pending.extendleft(reversed(batch))
            self._failed(error)
            return
        self._reached()

    def _heartbeat(self) -> None:
        try:
            self._redis.set(HOLDER_PREFIX + self.holder, b"1", ex=HOLDER_SECONDS)
        except self._errors as error:
            self._failed(error)
            return
        self._beat_at = time.monotonic()
        self._reached()

    def _failed(self, error: BaseException) -> None:
        self._down_until = time.monotonic() + DOWN_SECONDS
        self._on_error()
        if not self._outage_logged:
            self._outage_logged = True
            self._on_down(True)
            if self.fallback == "refuse":
                then = (
                    "requests of keys and teams limited per minute or in flight are refused "
                    "(503) until it can (LLMGW_LIMITS_REDIS_FALLBACK=refuse)"
                )
            else:
                then = "each machine counts alone until it can (LLMGW_LIMITS_REDIS_FALLBACK=alone)"
            log.warning(
                "gateway: Redis cannot be reached for the limits (%s); %s",
                type(error).__name__,
                then,
            )

    def _reached(self) -> None:
        if self._outage_logged:
            self._outage_logged = False
            self._on_down(False)
            self._heartbeat_soon()
            log.warning("gateway: Redis is reached again; limits count over every machine")

    def _heartbeat_soon(self) -> None:
        self._beat_at = 0.0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Write what is queued, let this process's name go, and stop the thread. The event
        loop's connections are dropped with the loop (their sockets close with it)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=2)
        if not self.down:
            self.flush()
            with contextlib.suppress(*self._errors):
                self._redis.delete(HOLDER_PREFIX + self.holder)
        self._redis.close()


def read_use(url: str, idents: Sequence[str], bucket: int) -> dict[str, tuple[int, int, int]]:
    """(in flight, requests, tokens in the last minute) of each ident, as every machine counts
    them in Redis (for the web, which counts nothing); raises when Redis cannot be reached."""
    timeout = conf.limits_redis_timeout()
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        pipe = client.pipeline(transaction=False)
        for ident in idents:
            pipe.hgetall(KEY_PREFIX + ident)
        found: dict[str, tuple[int, int, int]] = {}
        alive: dict[str, bool] = {}
        for ident, fields in zip(idents, pipe.execute(), strict=True):
            in_flight = requests = tokens = 0
            for raw_name, raw_value in fields.items():
                name, value = raw_name.decode(), int(raw_value)
                kind, rest = name[:1], name[2:]
                if kind == "f":
                    if rest not in alive:
                        alive[rest] = bool(client.exists(HOLDER_PREFIX + rest))
                    in_flight += value if alive[rest] else 0
                elif 0 <= bucket - int(rest) < BUCKETS:
                    requests += value if kind == "r" else 0
                    tokens += value if kind == "t" else 0
            found[ident] = (in_flight, requests, tokens)
        return found
    finally:
        client.close()


class _Connection(asyncio.Protocol):
    """One connection to Redis on the event loop, for the admissions of every request of the
    process at once: each command is written as it comes, and each answer, as Redis sends them
    in order, settles the oldest command waiting. No command waits for a connection, none
    holds one, and the event loop never blocks on it. (redis.asyncio spent 150 µs of CPU on
    an admission, against 90 for the blocking client; this, about 50: bench/limits.py.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.buffer = bytearray()
        self.lost: BaseException | None = None
        self.left = False
        self.loaded: set[str] = set()  # scripts Redis is known to hold (by sha1)

    @property
    def usable(self) -> bool:
        return self.lost is None and not self.left

    def leave(self, seconds: float) -> None:
        """Take no new command, and close in `seconds` (its late answers read meanwhile)."""
        if not self.left:
            self.left = True
            self.loop.call_later(seconds, self.close)

    @classmethod
    async def open(cls, url: str, loop: asyncio.AbstractEventLoop) -> _Connection:
        """Connected, signed in and on the URL's database."""
        options = redis.connection.parse_url(url)
        made = cls(loop)
        if "path" in options:
            await loop.create_unix_connection(lambda: made, options["path"])
        else:
            tls = None
            if options.get("connection_class") is redis.connection.SSLConnection:
                tls = ssl.create_default_context()
            await loop.create_connection(
                lambda: made, options.get("host", "localhost"), options.get("port", 6379), ssl=tls
            )
        try:
            if options.get("password") is not None:
                who = [options["username"]] if options.get("username") else []
                await made.send("AUTH", *who, options["password"])
            if options.get("db"):
                await made.send("SELECT", options["db"])
        except BaseException:
            made.close()
            raise
        return made

    def send(self, *parts: Any) -> asyncio.Future[Any]:
        """Write one command; its answer, when it comes."""
        answer = self.loop.create_future()
        if self.lost is not None or self.transport is None:
            answer.set_exception(redis.ConnectionError("the connection to Redis is lost"))
            return answer
        self.waiting.append(answer)
        self.transport.write(_command(parts))
        return answer

    def script(self, source: str, keys: Sequence[str], args: Sequence[Any]) -> asyncio.Future[Any]:
        """A Lua script's answer: by its digest once Redis holds it, else by its text."""
        digest = _digest(source)
        if digest not in self.loaded:
            answer = self.send("EVAL", source, len(keys), *keys, *args)
            answer.add_done_callback(
                lambda done: None if done.exception() else self.loaded.add(digest)
            )
            return answer
        # Redis may have lost it since (SCRIPT FLUSH): then, once more by its text.
        answer = self.loop.create_future()

        def ran(done: asyncio.Future[Any]) -> None:
            failed = done.exception()
            if failed is not None and str(failed).startswith("NOSCRIPT"):
                self.loaded.discard(digest)
                _settle(answer, self.script(source, keys, args))
            else:
                _settle(answer, done)

        self.send("EVALSHA", digest, len(keys), *keys, *args).add_done_callback(ran)
        return answer

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or redis.ConnectionError("Redis closed the connection")
        while self.waiting:
            waiting = self.waiting.popleft()
            if not waiting.done():
                waiting.set_exception(redis.ConnectionError(f"Redis went away: {self.lost}"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.waiting:
            read = _reply(self.buffer, 0)
            if read is None:
                return
            value, end = read
            del self.buffer[:end]
            answer = self.waiting.popleft()
            if answer.done():
                continue
            if isinstance(value, redis.ResponseError):
                answer.set_exception(value)
            else:
                answer.set_result(value)


def _settle(answer: asyncio.Future[Any], source: asyncio.Future[Any]) -> None:
    """`answer` settled as `source` is (now, or when it is)."""

    def copy(done: asyncio.Future[Any]) -> None:
        if answer.done():
            return
        failed = done.exception()
        if failed is not None:
            answer.set_exception(failed)
        else:
            answer.set_result(done.result())

    if source.done():
        copy(source)
    else:
        source.add_done_callback(copy)


def _command(parts: Sequence[Any]) -> bytes:
    """A command as Redis reads it (RESP): an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        raw = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


def _reply(buffer: bytearray, at: int) -> tuple[Any, int] | None:
    """The reply that starts at `at` and where it ends; None while it is not whole."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        return None
    kind, line = buffer[at], bytes(buffer[at + 1 : end])
    if kind == 0x3A:  # ":" an integer
        return int(line), end + 2
    if kind == 0x2B:  # "+" a simple string
        return line, end + 2
    if kind == 0x2D:  # "-" an error
        return redis.ResponseError(line.decode(errors="replace")), end + 2
    if kind == 0x24:  # "$" a bulk string (or nil)
        size = int(line)
        if size < 0:
            return None, end + 2
        if len(buffer) < end + 2 + size + 2:
            return None
        return bytes(buffer[end + 2 : end + 2 + size]), end + 4 + size
    if kind == 0x2A:  # "*" an array
        items, position = [], end + 2
        for _ in range(max(0, int(line))):
            read = _reply(buffer, position)
            if read is None:
                return None
            items.append(read[0])
            position = read[1]
        return items, position
    raise redis.ResponseError(f"Redis answered something unknown: {bytes(buffer[at:end])!r}")


@functools.cache
def _digest(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


def _decided(
    answer: Sequence[Any], idents: tuple[str, ...], bucket: int, reserved: tuple[int, ...]
) -> Decided:
    """The admission script's answer, read."""
    width = 2 + 2 * BUCKETS
    counted = tuple(
        Counted(
            in_flight=int(answer[1 + i * width]),
            reserved=int(answer[2 + i * width]),
            requests=[int(v) for v in answer[3 + i * width : 3 + i * width + BUCKETS]],
            tokens=[int(v) for v in answer[3 + i * width + BUCKETS : 1 + (i + 1) * width]],
        )
        for i in range(len(idents))
    )
    return Decided(counted, int(answer[0]) == 0, idents, bucket, reserved)


def _keys(idents: Sequence[str]) -> list[str]:
    """The scripts' KEYS: each subject's counts, then each one's reservations."""
    return [KEY_PREFIX + ident for ident in idents] + [RESERVED_PREFIX + i for i in idents]


def _or_none(limit: int | None) -> int:
    return -1 if limit is None else limit
