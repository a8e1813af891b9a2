"""Sending a request on to a replica, and bringing its answer back without buffering a stream.

A request is sent once, and again, once, to another ready replica only where the first cannot
have served it (`should_retry`). Engines are reached over connections kept open between
requests, a pool per gateway process (`Upstream`, gateway.upstream): HTTP/1.1 written and
parsed by the gateway itself, which costs a third of aiohttp's client per request
(bench/gateway_profile.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from core import requestid

from . import conf, tracing
from . import upstream as lean
from .routing import Balancer, Candidate, Hold, Serve

CONNECT_TIMEOUT_SECONDS = lean.CONNECT_TIMEOUT_SECONDS
# A kept connection can be closed by the engine just as it is reused, which looks exactly like an
# engine that died with the request. So the pool drops a connection unused this long, well before
# engines close idle ones (the default engine's server after 5 s), and a failure on a reused connection
# before any answer came is tried once more on a new one to the same replica (_attempt): the
# engine closed it without reading the request, or it is gone, and then the new connection is
# refused, which should_retry sends elsewhere. This is the aiohttp sessions' (an engine's
# /tokenize, the web); the pool that sends requests to the engines keeps its connections
# upstream.IDLE_SECONDS.
IDLE_SECONDS = 2.0
POOL_SIZE = 0  # no limit: as many connections as requests in flight
JSON_HEADERS = {"Content-Type": "application/json"}


class UpstreamError(Exception):
    """An attempt to reach a replica failed."""


class NotConnected(UpstreamError):
    """The connection was never made: the engine did not see the request."""


class Broken(UpstreamError):
    """The connection failed after the request was sent, before an answer came."""


class Silent(UpstreamError):
    """The engine said nothing for the upstream timeout."""


# What reading a stream can raise once it has started.
STREAM_ERRORS = (OSError, lean.Lost, lean.Silent, asyncio.TimeoutError)


class ReplicaGone(Exception):
    """No replica gave an answer: the chosen one failed, and a retry was not possible or failed."""

    def __init__(self, candidate: Candidate, cause: BaseException) -> None:
        super().__init__(f"replica {candidate.id} at {candidate.endpoint}: {cause}")
        self.candidate = candidate
        self.cause = cause


class ReplicaTimeout(Exception):
    def __init__(self, candidate: Candidate, seconds: float) -> None:
        super().__init__(
            f"replica {candidate.id} at {candidate.endpoint} was silent for {seconds:.0f}s"
        )
        self.candidate = candidate
        self.seconds = seconds


@dataclass
class Answer:
    """A replica's answer: whole (`body`), or a stream that starts with `first`."""

    candidate: Candidate
    status: int
    content_type: str
    # A stream's connection, still reading it.
    connection: lean.Connection | None
    body: bytes | None = None
    first: bytes = b""
    retried: bool = False
    closed: bool = field(default=False)
    # How long each wait for a stream's next chunk may be (the upstream timeout).
    timeout: float = 0.0

    @property
    def streaming(self) -> bool:
        return self.body is None

    def close(self) -> None:
        """Let the connection go; closing it mid-stream tells the engine to stop generating."""
        if self.closed:
            return
        self.closed = True
        if self.connection is not None:
            # Kept for the next request when the stream ended whole, else closed.
            self.connection.done()


def should_retry(error: BaseException, *, still_routable: bool) -> bool:
    """Send the request to another replica? Only when the first attempt failed before anything
    reached the client, and either

    - the connection was never made (refused, unreachable): the engine cannot have seen the
      request, so sending it elsewhere is always safe; or
    - the replica was withdrawn since it was chosen (a rollout, an idle stop): it drains for
      fleet.services.DRAIN_SECONDS before it stops, so this is rare, but a request queued
      behind others can still be cut off when it stops.

    A replica that took the request and then failed while still in routing is not tried again
    elsewhere: the same request might well break the next one too."""
    if isinstance(error, NotConnected):
        return True
    return isinstance(error, Broken) and not still_routable


class Upstream:
    """The connections of one gateway process to the engines: the kept connections requests go
    over (gateway.upstream), and an aiohttp session for the engines' /tokenize (choice_tokens),
    which few requests need."""

    def __init__(self) -> None:
        self.pool = lean.Pool()
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        current = self._session
        if current is None or current.closed:
            connector = aiohttp.TCPConnector(
                limit=POOL_SIZE, keepalive_timeout=IDLE_SECONDS, ttl_dns_cache=60
            )
            current = self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_SECONDS),
            )
        return current

    async def close(self) -> None:
        self.pool.close()
        if self._session is not None:
            await self._session.close()
        self._session = None


async def send(
    serve: Serve,
    path: str,
    payload: bytes,
    *,
    stream: bool,
    balancer: Balancer,
    upstream: Upstream,
    refresh: Callable[[], Awaitable[tuple[Candidate, ...]]],
    prefix: Sequence[int] = (),
    hold: Hold | None = None,
    tracer: tracing.Tracer,
) -> Answer:
    """Send to the least busy candidate; retry once (see should_retry). The caller must
    release the answer's candidate from `balancer` when the answer is done with. `hold`: the
    slot the fair queue counted for this request, which the first choice takes over."""
    candidates = serve.candidates
    for attempt in (1, 2):
        candidate = balancer.choose(candidates, serve.engine_name, prefix, hold=hold)
        if tracer.on:
            tracer.current_event(
                "replica chosen",
                **{"llmgw.replica": candidate.id, "llmgw.route.reason": balancer.reason},
            )
        try:
            answer = await _attempt(
                upstream, candidate, path, payload, stream=stream, tracer=tracer
            )
        except Silent as exc:
            balancer.release(candidate)
            raise ReplicaTimeout(candidate, conf.upstream_timeout()) from exc
        except UpstreamError as exc:
            balancer.release(candidate)
            error = exc
        except BaseException:
            balancer.release(candidate)
            raise
        else:
            answer.retried = attempt > 1
            return answer
        if attempt == 2:
            raise ReplicaGone(candidate, error)
        fresh = await refresh()
        still_routable = any(c.id == candidate.id for c in fresh)
        others = tuple(c for c in fresh if c.id != candidate.id)
        if not others or not should_retry(error, still_routable=still_routable):
            raise ReplicaGone(candidate, error)
        if tracer.on:
            tracer.current_event("retry", **{"llmgw.replica": candidate.id, "error": str(error)})
        candidates = others
    raise AssertionError("unreachable")


async def _attempt(
    upstream: Upstream,
    candidate: Candidate,
    path: str,
    payload: bytes,
    *,
    stream: bool,
    tracer: tracing.Tracer,
) -> Answer:
    # The current span's traceparent for the engine ({} while tracing is off).
    traced = tracer.engine_headers()
    try:
        return await _post(
            upstream, candidate, path, payload, stream=stream, fresh=False, traced=traced
        )
    except _StaleConnection:
        return await _post(
            upstream, candidate, path, payload, stream=stream, fresh=True, traced=traced
        )


@functools.lru_cache(maxsize=8)
def _read_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """aiohttp's timeouts for the engine's /tokenize (choice_tokens)."""
    return aiohttp.ClientTimeout(
        total=None, sock_connect=CONNECT_TIMEOUT_SECONDS, sock_read=seconds
    )


class _StaleConnection(Exception):
    """A kept connection failed before any answer: try once on a new one."""


async def _post(
    upstream: Upstream,
    candidate: Candidate,
    path: str,
    payload: bytes,
    *,
    stream: bool,
    fresh: bool,
    traced: dict[str, str],
) -> Answer:
    timeout = conf.upstream_timeout()
    try:
        connection = await upstream.pool.connection(candidate.address, candidate.port, fresh=fresh)
    except lean.NotConnected as exc:
        raise NotConnected(str(exc)) from exc
    try:
        # The engine's key, and the request's ID for the engine's log (the default engine logs no
        # header today; a tracing proxy in front of it, or a later engine, may).
        more = {requestid.HEADER: requestid.now(), **traced}
        head = lean.request_head(
            "POST", candidate.address, candidate.port, path, candidate.headers, len(payload), more
        )
        connection.write(head, payload)
        # The upstream timeout bounds every wait for the engine: its answer's start, and each
        # chunk after.
        await connection.head(timeout)
        content_type = connection.content_type.decode("latin-1") or "application/json"
        status = connection.status
        if stream and status == 200:
            # The first chunk comes once the engine has started on this request: reading
            # it here means a replica that goes away while the request waits in its queue
            # can still be retried, before the client has been sent anything. Its reports of
            # the prompt's progress (with_progress) come first, while it reads the prompt:
            # the answer starts with the event after them.
            first = await connection.read(timeout)
            while first and _only_progress(first):
                progress = await connection.read(timeout)
                if not progress:
                    break
                first += progress
            return Answer(candidate, 200, content_type, connection, first=first, timeout=timeout)
        body = await connection.whole(timeout)
        connection.done()
        return Answer(candidate, status, content_type, None, body=body)
    except lean.Silent as exc:
        connection.close()
        raise Silent(f"silent for {timeout:.0f}s") from exc
    except lean.Lost as exc:
        connection.close()
        if connection.reused and not fresh and not exc.answered:
            raise _StaleConnection() from exc
        raise Broken(str(exc)) from exc
    except ValueError as exc:  # a header that cannot be sent (request_head)
        connection.done()
        raise Broken(str(exc)) from exc
    except BaseException:
        connection.close()
        raise


# -- tokens -----------------------------------------------------------------------------

_USAGE_NUMBER = re.compile(
    rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens|cache_read_input_tokens'
    rb'|cache_creation_input_tokens)"\s*:\s*(\d+)'
)
PROGRESS = b'"prompt_progress"'
_PROGRESS_TOTAL = re.compile(rb'"prompt_progress"\s*:\s*\{[^}]*"total"\s*:\s*(\d+)')
_PREDICTED = re.compile(rb'"predicted_n"\s*:\s*(\d+)')
_INDEX = re.compile(rb'"index"\s*:\s*(\d+)')
# Where an event of a stream ends: a blank line (the default engine writes "\n\n", others "\r\n\r\n").
_EVENT_END = re.compile(rb"\r?\n\r?\n")
# The most of an event not yet whole a stream holds back (a token's event is a few hundred
# bytes); past it, it goes on as it is.
MAX_PART_BYTES = 1024 * 1024


def usage_of(body: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens from an answer's "usage", without parsing the whole body, in
    each API's words: OpenAI's chat and completions (prompt_tokens, completion_tokens), its
    Responses API (input_tokens, output_tokens) and Anthropic's (input_tokens, the prompt's
    tokens not read from a cache, plus cache_read_input_tokens and cache_creation_input_tokens;
    output_tokens)."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return 0, 0
    numbers = dict(_USAGE_NUMBER.findall(body[at : at + 400]))
    if b"prompt_tokens" in numbers or b"completion_tokens" in numbers:
        return int(numbers.get(b"prompt_tokens", 0)), int(numbers.get(b"completion_tokens", 0))
    prompt = sum(
        int(numbers.get(name, 0))
        for name in (b"input_tokens", b"cache_read_input_tokens", b"cache_creation_input_tokens")
    )
    return prompt, int(numbers.get(b"output_tokens", 0))


def with_progress(payload: bytes) -> bytes:
    """A streamed request's body asking the engine to report its prompt's progress first
    (the default engine's return_progress): the first report gives the prompt's tokens, as the engine
    counts them (its chat template included), before any is generated, at no cost of a round
    trip; so a stream cut short is charged its prompt. The gateway takes the reports out of
    what the client is sent (StreamTally)."""
    start = payload.find(b"{")
    return payload[: start + 1] + b'"return_progress":true,' + payload[start + 1 :]


def _only_progress(data: bytes) -> bool:
    """Whether `data` holds only whole events that report the prompt's progress."""
    reports = data.count(PROGRESS)
    return reports > 0 and reports == data.count(b"data:") and data.endswith((b"\n\n", b"\n\r\n"))


class StreamTally:
    """Tokens of a streamed answer, counted from the events as they pass; with `strip`, the
    engine's reports of the prompt's progress (asked for by the gateway, with_progress) taken
    out of what is passed on.

    - The prompt: the engine's last "usage", else its first report of the prompt's progress
      (its total), so that a stream cut before its end is charged its prompt.
    - The answer: the default engine sends one event per generated token (its text may be empty while a
      multi-byte character is incomplete), plus a first chat event with the role and a last
      one with the finish reason, which says how many tokens its choice had ("timings"); a
      "usage" event, when the engine sends one, wins. Each choice (n > 1) ends with its own:
      the answer's tokens are every choice's.

    `feed` passes on whole events only (a part of one, up to MAX_PART_BYTES, waits for its
    end): a client reads an event when it is whole anyway.
    """

    def __init__(self, *, strip: bool = False, model: str = "") -> None:
        self.model = model  # the name the client asked for
        self.prompt = 0
        self.completion = 0
        self.strip = strip
        self._tail = b""
        # Per choice (its index): its tokens as the engine said when it ended.
        self._ended: dict[int, int] = {}
        self._usage: dict[int, tuple[int, int]] = {}
        self._last_ended = 0

    def feed(self, chunk: bytes) -> bytes:
        """Count `chunk`'s whole events; what to pass on of it."""
        if self._tail:
            chunk, self._tail = self._tail + chunk, b""
        cut = _events_end(chunk)
        if cut < len(chunk) and len(chunk) - cut <= MAX_PART_BYTES:
            chunk, self._tail = chunk[:cut], chunk[cut:]
        if not chunk:
            return b""
        return self._count(chunk)

    def end(self) -> bytes:
        """What is left of the stream once it ended (an event without its blank line)."""
        rest, self._tail = self._tail, b""
        return self._count(rest) if rest else b""

    def _count(self, events: bytes) -> bytes:
        if PROGRESS not in events:
            self._tokens(events)
            if b'"usage"' in events or b'"predicted_n"' in events:
                for event in _split_events(events):
                    self._ending(event)
            return events
        kept = []
        for event in _split_events(events):
            if PROGRESS in event:
                # A report of the prompt's progress (an empty event otherwise): its total is
                # the prompt's tokens.
                found = _PROGRESS_TOTAL.search(event)
                if found is not None and not self.prompt:
                    self.prompt = int(found.group(1))
                if not self.strip:
                    kept.append(event)
                continue
            self._tokens(event)
            self._ending(event)
            kept.append(event)
        return b"".join(kept)

    def _tokens(self, events: bytes) -> None:
        self.completion += (
            events.count(b'"finish_reason": null')
            + events.count(b'"finish_reason":null')
            - events.count(b'"role":')
        )

    def _ending(self, event: bytes) -> None:
        """A choice's last event (its tokens, in "timings"), or a "usage" event (after the
        choice that ended last, when it names none: a chat's has no choices)."""
        if b'"finish_reason":"' in event or b'"finish_reason": "' in event:
            found = _INDEX.search(event)
            self._last_ended = int(found.group(1)) if found is not None else 0
            predicted = _PREDICTED.search(event)
            if predicted is not None:
                self._ended[self._last_ended] = int(predicted.group(1))
        if b'"usage"' in event:
            prompt, completion = usage_of(event)
            if prompt or completion:
                self._usage[self._last_ended] = (prompt, completion)

    def totals(self) -> tuple[int, int]:
        """(prompt, completion) tokens: every choice's."""
        ended = {**self._ended, **{i: c for i, (_, c) in self._usage.items()}}
        prompt = max((p for p, _ in self._usage.values()), default=0) or self.prompt
        # The choices that ended said how many tokens they had; a stream cut short has its
        # events (the text of a character split over tokens waits for its end: a token or
        # two fewer).
        return prompt, max(self.completion, sum(ended.values()), 0)


class AnthropicTally(StreamTally):
    """Tokens of a Messages API stream: the prompt's in its message_start event, the answer's in
    its last message_delta; a stream cut short, one a content_block_delta event.

    It also makes the stream start as Anthropic's clients require: the default engine sends message_start
    with the first token that has text, so where the first tokens are parts of a character (a
    random model's, or a word of CJK text) the stream starts with a later event, and the SDKs
    raise "unexpected event order". Such a stream is given its message_start first."""

    def __init__(self, *, strip: bool = False, model: str = "") -> None:
        super().__init__(strip=strip, model=model)
        self._started = False

    def feed(self, chunk: bytes) -> bytes:
        return self._start(super().feed(chunk))

    def end(self) -> bytes:
        return self._start(super().end())

    def _start(self, passed: bytes) -> bytes:
        if self._started or not passed:
            return passed
        self._started = True
        if b'"type":"message_start"' in passed[: passed.find(b"\n\n") + 1 or len(passed)]:
            return passed
        message: dict[str, Any] = {
            "id": f"msg_{requestid.now()}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt, "output_tokens": 0},
        }
        event = {"type": "message_start", "message": message}
        return b"event: message_start\ndata: " + json.dumps(event).encode() + b"\n\n" + passed

    def _tokens(self, events: bytes) -> None:
        self.completion += events.count(b'"type":"content_block_delta"')

    def _ending(self, event: bytes) -> None:
        if b'"usage"' not in event:
            return
        prompt, completion = usage_of(event)
        if b'"type":"message_start"' in event:
            self.prompt = prompt
        elif prompt or completion:
            self._usage[0] = (prompt, completion)


def starts_message(first: bytes) -> bool:
    """Whether a Messages stream's first chunk holds its message_start."""
    return b'"type":"message_start"' in first


async def prompt_tokens(upstream: Upstream, candidate: Candidate, payload: bytes) -> int:
    """A Messages request's prompt tokens as the engine counts them (its count_tokens, which
    applies the chat template as the answer's prompt did); 0 where it cannot say."""
    session = upstream.session()
    try:
        async with session.post(
            f"{candidate.endpoint}/v1/messages/count_tokens",
            data=payload,
            headers={**candidate.headers, **JSON_HEADERS},
            timeout=_read_timeout(conf.upstream_timeout()),
        ) as response:
            if response.status == 200:
                counted = (await response.json(content_type=None)).get("input_tokens")
                if isinstance(counted, int) and counted >= 0:
                    return counted
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, AttributeError):
        pass
    return 0


class ResponsesTally(StreamTally):
    """Tokens of a Responses API stream: both in its response.completed event; a stream cut
    short, one a text or tool-call delta event."""

    def _tokens(self, events: bytes) -> None:
        self.completion += events.count(b'"type":"response.output_text.delta"') + events.count(
            b'"type":"response.function_call_arguments.delta"'
        )

    def _ending(self, event: bytes) -> None:
        if b'"type":"response.completed"' in event:
            prompt, completion = usage_of(event)
            if prompt or completion:
                self._usage[0] = (prompt, completion)


def _events_end(data: bytes) -> int:
    """Where the last whole event of `data` ends (0: none does)."""
    if data.endswith(b"\n\n"):
        return len(data)  # the usual chunk: whole events
    at = max(data.rfind(b"\n\n"), data.rfind(b"\n\r\n"))
    return at + (2 if data[at : at + 2] == b"\n\n" else 3) if at >= 0 else 0


def _split_events(data: bytes) -> list[bytes]:
    """`data`'s events, each with its blank line."""
    events, start = [], 0
    for end in _EVENT_END.finditer(data):
        events.append(data[start : end.end()])
        start = end.end()
    if start < len(data):
        events.append(data[start:])
    return events


async def choice_tokens(
    upstream: Upstream, candidate: Candidate, body: bytes, most: int | None
) -> int:
    """The tokens of every choice of a whole answer but its first, which the default engine's "usage"
    counts alone (n > 1, or several prompts): a choice cut by its max_tokens had that many;
    another's text is counted by the engine's tokenizer (/tokenize), else one a byte."""
    try:
        choices = json.loads(body).get("choices")
    except (ValueError, AttributeError):
        return 0
    if not isinstance(choices, list) or len(choices) < 2:
        return 0
    texts = []
    total = 0
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) == 0:
            continue
        if choice.get("finish_reason") == "length" and most is not None:
            total += most
            continue
        message = choice.get("message")
        text = choice.get("text") if message is None else message.get("content")
        if isinstance(text, str) and text:
            texts.append(text)
    counted = await asyncio.gather(*(_tokenized(upstream, candidate, t) for t in texts))
    return total + sum(counted)


async def _tokenized(upstream: Upstream, candidate: Candidate, text: str) -> int:
    session = upstream.session()
    try:
        async with session.post(
            f"{candidate.endpoint}/tokenize",
            data=json.dumps({"content": text, "add_special": False}),
            headers=candidate.headers,
            timeout=_read_timeout(CONNECT_TIMEOUT_SECONDS),
        ) as response:
            if response.status == 200:
                tokens = (await response.json(content_type=None)).get("tokens")
                if isinstance(tokens, list):
                    return len(tokens)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        pass
    return len(text.encode())
