"""Keys' and teams' rate limits across several gateway machines, counted in Redis.

gateway.limits counts exactly across the gateway processes of one machine. With REDIS_URL set
(and LLMGW_LIMITS_REDIS not "off"), a key or team with a requests-per-minute, tokens-per-minute
or in-flight limit is also counted in Redis, where every machine's gateway processes count
together:

- Admission is one Redis round trip: a script reads the subject's counts (the key's and its
  team's), decides and, when the request goes, counts it, atomically. So the requests per
  minute and in flight of a key or team are exact over every machine, as they are over one.
- The end of a request (in flight down, its tokens counted) is not on the request's path: it
  is queued and written by a thread every FLUSH_SECONDS, in one pipeline for all that ended.
  So another machine sees a request end up to FLUSH_SECONDS (plus a round trip) late, which
  can only refuse early, never let more through.
- Tokens per minute: as on one machine, a request is let through while the tokens counted are
  below the limit, and its own tokens (known when it ends) may take it over.

Each gateway process counts its in-flight requests under a name of its own (`holder`), which
it keeps alive in Redis (HOLDER_SECONDS, renewed every HEARTBEAT_SECONDS by the same thread). A
process that dies stops holding its requests in flight when its name expires: until then
(at most HOLDER_SECONDS), they still count, which refuses early, never lets more through.

When Redis cannot be reached (a refused connection, or no answer within TIMEOUT_SECONDS),
each machine decides alone by its own counts, for DOWN_SECONDS before it tries Redis again:
while Redis is down, a limit can be passed by as many times as there are machines taking the
key's requests. Each failure is counted in llmgw_gateway_limits_redis_errors_total and logged
once per outage. The budgets (tokens per day and month) are not counted here: they come from
the traffic book's rows in the database, which every machine writes (gateway.limits.Budgets).

Redis holds one hash per key or team in use (`llmgw:limits:IDENT`: two fields per 5-second
bucket of the last 65 s, one per process with requests in flight), dropped an hour after its
last request. The queue of ended requests not yet written is bounded (MAX_PENDING; past it the
oldest are dropped and counted in llmgw_gateway_limits_redis_dropped_total): a dropped end
leaves a request counted in flight until its process's name expires.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

log = logging.getLogger("llmgw.gateway")

KEY_PREFIX = "llmgw:limits:"
HOLDER_PREFIX = "llmgw:limits-holder:"
TIMEOUT_SECONDS = 0.25
DOWN_SECONDS = 5.0
FLUSH_SECONDS = 0.05
HEARTBEAT_SECONDS = 5.0
HOLDER_SECONDS = 20
KEEP_SECONDS = 3600
MAX_PENDING = 100_000
BUCKETS = 13  # as gateway.limits: 5-second buckets, a minute and one bucket

# KEYS: one hash per subject. ARGV: the bucket now, this process's name, the holders' prefix,
# then per subject its in-flight, requests-per-minute and tokens-per-minute limits (-1: none).
# Answers: the first subject (1-based) whose limit refuses the request (0: it was counted),
# then per subject its in-flight count and its requests and tokens by bucket age (13 each).
_ADMIT = """
local bucket = tonumber(ARGV[1])
local holder = ARGV[2]
local holders = ARGV[3]
local answer = {0}
local refused = 0
for i = 1, #KEYS do
  local parallel = tonumber(ARGV[1 + 3 * i])
  local rpm = tonumber(ARGV[2 + 3 * i])
  local tpm = tonumber(ARGV[3 + 3 * i])
  local fields = redis.call('HGETALL', KEYS[i])
  local in_flight, requests, tokens = 0, {}, {}
  for age = 1, 13 do requests[age] = 0; tokens[age] = 0 end
  for j = 1, #fields, 2 do
    local name, value = fields[j], tonumber(fields[j + 1])
    local kind, rest = string.sub(name, 1, 1), string.sub(name, 3)
    if kind == 'f' then
      if rest == holder or redis.call('EXISTS', holders .. rest) == 1 then
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
  local asked, used = 0, 0
  for age = 1, 13 do asked = asked + requests[age]; used = used + tokens[age] end
  if refused == 0 and ((parallel >= 0 and in_flight >= parallel) or (rpm >= 0 and asked >= rpm)
      or (tpm >= 0 and used >= tpm)) then
    refused = i
  end
  answer[#answer + 1] = in_flight
  for age = 1, 13 do answer[#answer + 1] = requests[age] end
  for age = 1, 13 do answer[#answer + 1] = tokens[age] end
end
answer[1] = refused
if refused == 0 then
  for i = 1, #KEYS do
    redis.call('HINCRBY', KEYS[i], 'r:' .. bucket, 1)
    redis.call('HINCRBY', KEYS[i], 'f:' .. holder, 1)
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[#ARGV]))
  end
end
return answer
"""

# KEYS: one hash per subject. ARGV: this process's name, the bucket, tokens, requests to take
# back (1 when a request counted here was refused by a limit only the machine knows).
_END = """
for i = 1, #KEYS do
  local left = redis.call('HINCRBY', KEYS[i], 'f:' .. ARGV[1], -1)
  if left <= 0 then redis.call('HDEL', KEYS[i], 'f:' .. ARGV[1]) end
  if tonumber(ARGV[3]) > 0 then redis.call('HINCRBY', KEYS[i], 't:' .. ARGV[2], ARGV[3]) end
  if tonumber(ARGV[4]) > 0 then
    local kept = redis.call('HINCRBY', KEYS[i], 'r:' .. ARGV[2], -tonumber(ARGV[4]))
    if kept <= 0 then redis.call('HDEL', KEYS[i], 'r:' .. ARGV[2]) end
  end
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Counted:
    """One subject's counts over every machine, before this request: in flight, and requests
    and tokens by the age of their 5-second bucket (0: the current one)."""

    in_flight: int
    requests: list[int]
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Decided:
    """What Redis decided for a request: its subjects' counts, and whether it was counted."""

    counted: tuple[Counted, ...]
    admitted: bool
    idents: tuple[str, ...]
    bucket: int


class RedisLimits:
    """This process's connection to the limits kept in Redis (see the module's docstring)."""

    def __init__(self, url: str, *, on_error: Any = None, on_drop: Any = None) -> None:
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=TIMEOUT_SECONDS,
            socket_connect_timeout=TIMEOUT_SECONDS,
            health_check_interval=0,
        )
        self._errors = (redis.RedisError, OSError)
        self._admit = self._redis.register_script(_ADMIT)
        self._end = self._redis.register_script(_END)
        self.holder = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._pending: deque[tuple[tuple[str, ...], int, int, int]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._down_until = 0.0
        self._outage_logged = False
        self._on_error = on_error or (lambda: None)
        self._on_drop = on_drop or (lambda: None)
        self._thread = threading.Thread(target=self._run, name="llmgw-limits-redis", daemon=True)
        self._beat_at = 0.0
        self._heartbeat()
        self._thread.start()

    # -- the request's path ----------------------------------------------------------------

    def admit(
        self, subjects: Sequence[tuple[str, int | None, int | None, int | None]], bucket: int
    ) -> Decided | None:
        """Decide and count one request in one round trip: `subjects` are (ident,
        max_parallel, rpm, tpm). None when Redis is down: the machine decides alone."""
        if not subjects or time.monotonic() < self._down_until:
            return None
        args: list[Any] = [bucket, self.holder, HOLDER_PREFIX]
        for _, parallel, rpm, tpm in subjects:
            args += [_or_none(parallel), _or_none(rpm), _or_none(tpm)]
        args.append(KEEP_SECONDS)
        idents = tuple(ident for ident, *_ in subjects)
        try:
            answer = self._admit(keys=[KEY_PREFIX + ident for ident in idents], args=args)
        except self._errors as error:
            self._failed(error)
            return None
        self._reached()
        width = 1 + 2 * BUCKETS
        counted = tuple(
            Counted(
                in_flight=int(answer[1 + i * width]),
                requests=[int(v) for v in answer[2 + i * width : 2 + i * width + BUCKETS]],
                tokens=[int(v) for v in answer[2 + i * width + BUCKETS : 1 + (i + 1) * width]],
            )
            for i in range(len(idents))
        )
        return Decided(counted, int(answer[0]) == 0, idents, bucket)

    def end(self, decided: Decided, tokens: int, bucket: int, *, taken_back: bool = False) -> None:
        """A request counted here ended (or, `taken_back`, was refused after all): written
        with the next flush, off the request's path."""
        if not decided.admitted:
            return
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
            self._on_drop()
        self._pending.append((decided.idents, bucket, max(0, tokens), int(taken_back)))

    # -- the thread: ends written, this process's name kept alive ----------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(FLUSH_SECONDS)
            self._wake.clear()
            if time.monotonic() < self._down_until:
                continue
            self.flush()
            if time.monotonic() - self._beat_at >= HEARTBEAT_SECONDS:
                self._heartbeat()

    def flush(self) -> None:
        """Write every queued end, in one pipeline (kept queued if Redis cannot be reached)."""
        if not self._pending:
            return
        batch: list[tuple[tuple[str, ...], int, int, int]] = []
        while self._pending and len(batch) < 1000:
            batch.append(self._pending.popleft())
        pipe = self._redis.pipeline(transaction=False)
        for idents, bucket, tokens, taken_back in batch:
            self._end(
                keys=[KEY_PREFIX + ident for ident in idents],
                args=[self.holder, bucket, tokens, taken_back],
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
            log.warning(
                "gateway: Redis cannot be reached for the limits (%s); each machine counts "
                "alone until it can",
                type(error).__name__,
            )

    def _reached(self) -> None:
        if self._outage_logged:
            self._outage_logged = False
            self._heartbeat_soon()
            log.warning("gateway: Redis is reached again; limits count over every machine")

    def _heartbeat_soon(self) -> None:
        self._beat_at = 0.0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Write what is queued, let this process's name go, and stop the thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=2)
        if time.monotonic() >= self._down_until:
            self.flush()
            with contextlib.suppress(*self._errors):
                self._redis.delete(HOLDER_PREFIX + self.holder)
        self._redis.close()


def read_use(url: str, idents: Sequence[str], bucket: int) -> dict[str, tuple[int, int, int]]:
    """(in flight, requests, tokens in the last minute) of each ident, as every machine counts
    them in Redis (for the web, which counts nothing); raises when Redis cannot be reached."""
    client = redis.Redis.from_url(
        url, socket_timeout=TIMEOUT_SECONDS, socket_connect_timeout=TIMEOUT_SECONDS
    )
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


def _or_none(limit: int | None) -> int:
    return -1 if limit is None else limit
