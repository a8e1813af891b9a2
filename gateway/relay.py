"""The /v1/ endpoints: a client's request checked, sent on to a replica and its answer relayed.

A generating request goes through four steps, each a function below:

- decide: the key, the body, the model and the key's limits, then routing's choice of the
  replicas that may serve it (waiting for one to start, within LLMGW_GATEWAY_WAIT);
- prepare: what the engine is sent (the name it serves, the adapter it applies), the prompt's
  block hashes when the model routes by prefix, the key's weight in the fair queue;
- send: its turn in the fair queue, then the request to a replica (gateway.proxy: retries);
- answer: the replica's answer passed on, whole or as a stream.

Each step returns what the next needs or a Reply: what the client is told, and the figures
it counts for. `_answer` is the one place a request's outcome is counted (/metrics and the
traffic figures), before a whole answer is sent (a client that has it may look at the figures
at once) and after a stream ends (its status is known only then).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from access.models import hash_key
from access.services import KEY_PREFIX
from core import jsontext, requestid

from . import canary, conf, errors, fairqueue, http, limits, proxy, routing, validate
from . import images as gateway_images
from .endpoints import ENDPOINTS, Endpoint
from .errors import Refusal
from .http import Headers, Receive, Scope, Send
from .prefix import block_hashes
from .state import POLL_SECONDS, KeyState, Snapshot

if TYPE_CHECKING:
    from .process import Gateway

log = logging.getLogger("llmgw.gateway")

MODEL_HEADER = "X-LLMGW-Model"
# The weights that answered (fleet.specs.weights_revision): old or new during a canary update.
REVISION_HEADER = "X-LLMGW-Revision"
REQUEST_ID_HEADER = requestid.HEADER
_MODEL_FIELD, _REVISION_FIELD = (name.lower().encode() for name in (MODEL_HEADER, REVISION_HEADER))
# How often a request waiting for a replica looks at the (in-memory) state again.
WAIT_POLL_SECONDS = 0.1
# How long at most a request for something unknown (a key, a model) waits for the state to be
# looked at again; it is answered as soon as a look that began after it arrived is done (within
# a poll or two, idle), so the bound matters only when the refresher is slow (a loaded machine).
FRESH_LOOK_SECONDS = 2 * POLL_SECONDS + 1.5
# JSON bodies: a depth no OpenAI request comes near, and integers of sane size.
MAX_DEPTH = 64

Handler = Callable[["Gateway", Scope, Receive, Send], Awaitable[None]]


# -- one request --------------------------------------------------------------------------


@dataclass
class Call:
    """One request on its way through the gateway, and what it leaves for the traffic figures
    (access.traffic), gathered as it goes: its key, when it started, its tokens."""

    gateway: Gateway
    send: Send
    receive: Receive
    endpoint: Endpoint
    started: float
    # Sent back as X-Request-ID (gateway.http.start) and named in the gateway's log lines about
    # the request: the one gateway.app chose for it (core.requestid).
    request_id: str = field(default_factory=requestid.now)
    key_id: int | None = None
    prompt: int = 0
    completion: int = 0
    revision: str = ""  # of the replica that answered (none for a fallback's answer)
    # The model has a canary under way: its figures are kept per key too (registry.canary).
    canary: bool = False
    # A limited key's x-ratelimit-* headers, which every answer to the request carries; and
    # the key, while its limits are not checked yet (its answer then says where they stand).
    limit_headers: tuple[tuple[bytes, bytes], ...] = ()
    unchecked: KeyState | None = None
    # The request's server span while tracing is on (gateway.tracing), else None.
    span: Any = None
    # Seconds it waited for its turn in the fair queue.
    queued: float = 0.0

    def extra_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """The x-ratelimit-* headers of the request's answer: the admission's, or, for an
        answer before its limits were checked (a bad body, an unknown model), where they
        stand now."""
        key = self.unchecked
        if key is None or key.limits is None:
            return self.limit_headers
        self.unchecked = None
        team_id = key.limits.team_id
        team = self.gateway.state.get().teams.get(team_id) if team_id is not None else None
        found = self.gateway.counters.peek(key.id, key.limits, team)
        return tuple((k.encode(), v.encode()) for k, v in found)

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        self.prompt += prompt
        self.completion += completion
        board = self.gateway.metrics
        if prompt:
            board.tokens.labels(model, "prompt").inc(prompt)
        if completion:
            board.tokens.labels(model, "completion").inc(completion)

    def usage(self) -> dict[str, int]:
        """The request's tokens, as trace attributes."""
        return {
            "gen_ai.usage.input_tokens": self.prompt,
            "gen_ai.usage.output_tokens": self.completion,
        }

    def answered_by(self, candidate: routing.Candidate, decision: routing.Serve) -> None:
        """The request's figures count for the revision of the replica that answered it."""
        if decision.fallback_from is None:
            self.revision = candidate.revision


@dataclass
class Reply:
    """What the client is told, and what it counts for: the name asked for and the model that
    answered (a fallback's), or nothing counted (`name` None) for a request that never named a
    model it may use, or a client that went away."""

    status: int
    body: bytes = b""
    headers: Headers | None = None
    name: str | None = None
    answered_by: str = ""
    # A stream: the answer to relay once the reply is counted as started (status 200).
    stream: Streamed | None = None
    # Nothing is sent (the client went away).
    silent: bool = False
    # The request's turn in the fair queue, held until the answer is sent.
    turn: AbstractAsyncContextManager[Any] | None = None
    # What the gateway refused it for (its body is in OpenAI's shape; an endpoint of another
    # API writes it in its own).
    refusal: Refusal | None = None


def _refused(refusal: Refusal, name: str | None = None, answered_by: str = "") -> Reply:
    headers = [*http.JSON, *((k.lower().encode(), v.encode()) for k, v in refusal.headers.items())]
    return Reply(refusal.status, b"", headers, name, answered_by, refusal=refusal)


_GONE = Reply(0, silent=True)


# -- keys ---------------------------------------------------------------------------------


async def fresh_look(gateway: Gateway, since: float) -> Snapshot:
    """The state once the refresher has looked at the database after `since` (bounded wait)."""
    state = gateway.state
    deadline = time.monotonic() + FRESH_LOOK_SECONDS
    while not state.looked_since(since) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return state.get()


async def key_refusal(
    gateway: Gateway, scope: Scope, arrived: float, call: Call | None = None
) -> KeyState | Refusal:
    """The request's gateway key when it is active (and not expired); else the 401 to answer
    with."""
    scheme, _, secret = http.header(scope, b"authorization").partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        # Anthropic's clients send theirs as x-api-key.
        secret = http.header(scope, b"x-api-key").strip()
        if not secret:
            return errors.missing_key()
    if not secret.startswith(KEY_PREFIX):
        return errors.invalid_key(revoked=False)  # not one of ours
    digest = hash_key(secret)
    key = gateway.state.get().keys.get(digest)
    if key is None:
        # Perhaps created a moment ago: wait for the next look rather than refuse it.
        key = (await fresh_look(gateway, arrived)).keys.get(digest)
    if key is None or not key.active:
        return errors.invalid_key(revoked=key is not None)
    expires_at = key.limits.expires_at if key.limits is not None else None
    if expires_at is not None and time.time() >= expires_at:
        gateway.metrics.limited.labels("expired", "key").inc()
        return errors.expired_key(_utc(expires_at))
    gateway.state.key_used(key.id)
    if call is not None:
        call.key_id = key.id
        if key.limits is not None:
            call.unchecked = key
    return key


def _utc(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def allows(key: KeyState, snapshot: Snapshot, name: str) -> bool:
    """Whether the key (and its team) may ask for the model or adapter `name`."""
    if key.limits is None:
        return True
    if not key.limits.allows(name):
        return False
    team = snapshot.teams.get(key.limits.team_id) if key.limits.team_id is not None else None
    return team is None or team.allows(name)


# -- /v1/models ---------------------------------------------------------------------------


async def models(
    gateway: Gateway, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint
) -> None:
    call = Call(gateway, send, receive, endpoint, time.monotonic())
    if scope["method"] != "GET":
        refusal = errors.wrong_method("/v1/models", "GET")
        await _answer(call, _refused(refusal))
        return
    key = await key_refusal(gateway, scope, call.started, call)
    if isinstance(key, Refusal):
        await _answer(call, _refused(key))
        return
    snapshot = gateway.state.get()
    data = [
        {
            "id": entry.name,
            "object": "model",
            "created": entry.created,
            "owned_by": entry.owner or "llmgw",
            # As vLLM names them: an adapter's parent is the model whose replicas serve it.
            "root": entry.model,
            "parent": entry.model if entry.adapter else None,
            # What Anthropic's clients read of a model (the same list answers both).
            "type": "model",
            "display_name": entry.name,
            "created_at": _rfc3339(entry.created),
        }
        for entry in sorted(snapshot.catalog.usable(), key=lambda e: e.name)
        # A key limited to some models sees only those.
        if key.limits is None or allows(key, snapshot, entry.name)
    ]
    listed = {
        "object": "list",
        "data": data,
        # Anthropic's page of models: the whole list, one page.
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
    call.unchecked = None  # /v1/models counts against no limit
    await _answer(call, Reply(200, json.dumps(listed).encode()))


def _rfc3339(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- request bodies -----------------------------------------------------------------------


def parse_body(raw: bytes) -> dict[str, Any] | Refusal:
    """The request's JSON object, or a 400 saying what is wrong with it (never an exception)."""
    try:
        body = jsontext.loads(raw, unique_keys=False)
    except jsontext.JSONRefused as exc:
        return errors.bad_request(
            f"The request body was refused: {exc}; send ordinary JSON numbers."
        )
    except RecursionError:
        return errors.bad_request(
            f"The request body is nested too deeply; keep it within {MAX_DEPTH} levels."
        )
    except (ValueError, UnicodeDecodeError):
        return errors.bad_request("The request body is not JSON; send a JSON object.")
    if not isinstance(body, dict):
        return errors.bad_request("The request body must be a JSON object.")
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(body) > MAX_DEPTH:
        return errors.bad_request(
            f"The request body is nested too deeply; keep it within {MAX_DEPTH} levels."
        )
    name = body.get("model")
    if not isinstance(name, str) or not name:
        return errors.bad_request(
            "Say which model should answer: the body needs a 'model' (GET /v1/models lists them).",
            param="model",
        )
    return body


def _depth(value: Any) -> int:
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            return depth
        children = item.values() if isinstance(item, dict) else item
        pending.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


# -- the generating endpoints ------------------------------------------------------------


def routes(endpoints: Sequence[Endpoint]) -> dict[str, Handler]:
    """The handler of each endpoint's path, which gateway.app dispatches by (ROUTES)."""
    return {endpoint.path: Route(endpoint) for endpoint in endpoints}


@dataclass(frozen=True)
class Route:
    """An endpoint's handler: relayed to a replica, or answered from the gateway's state."""

    endpoint: Endpoint

    async def __call__(self, gateway: Gateway, scope: Scope, receive: Receive, send: Send) -> None:
        serve = relay if self.endpoint.relayed else models
        await serve(gateway, scope, receive, send, self.endpoint)


@dataclass
class Asked:
    """A request the gateway will route: its key, body and the catalog entry it names."""

    key: KeyState
    body: dict[str, Any]
    raw: bytes
    entry: routing.Entry
    snapshot: Snapshot
    stream: bool
    # Remote images the body names, for the gateway to fetch once the request is admitted.
    images: list[str] = field(default_factory=list)


@dataclass
class Prepared:
    """What is sent, and to which replicas."""

    decision: routing.Serve
    payload: bytes
    # The engine names its base model in answers; an adapter's answer names the adapter.
    rename: tuple[str, str] | None
    refresh: Callable[[], Awaitable[tuple[routing.Candidate, ...]]]
    prefix: list[int]
    weight: float


async def relay(
    gateway: Gateway, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint
) -> None:
    call = Call(gateway, send, receive, endpoint, time.monotonic())
    tracer = gateway.tracer
    if not tracer.on:
        await _relay(call, scope)
        return
    with tracer.request(scope, endpoint.operation, call.request_id) as span:
        call.span = span
        await _relay(call, scope)


def _step(call: Call, name: str) -> AbstractContextManager[Any]:
    """A child span of the request's while tracing is on; a context that does nothing else."""
    return _NO_SPAN if call.span is None else call.gateway.tracer.step(name)


_NO_SPAN = nullcontext()


async def _relay(call: Call, scope: Scope) -> None:
    gateway, endpoint = call.gateway, call.endpoint
    asked = await _asked(call, scope)
    if isinstance(asked, Reply):
        await _answer(call, asked)
        return
    entry = asked.entry
    admission = None
    if asked.key.limits is not None:
        admitted = await _admit(call, asked)
        if isinstance(admitted, Refusal):
            await _answer(call, _refused(admitted, entry.name))
            return
        admission = admitted
    board = gateway.metrics
    board.in_flight.labels(entry.name).inc()
    try:
        await _answer(call, await _route_and_send(call, asked))
    finally:
        if admission is not None:
            # However the request ended (answered, refused, client gone, engine broken).
            admission.release(call.prompt + call.completion)
        board.in_flight.labels(entry.name).dec()
        board.latency.labels(entry.name, endpoint.name).observe(time.monotonic() - call.started)


async def _asked(call: Call, scope: Scope) -> Asked | Reply:
    """Decide, first part: the request's key, its body, and the model it may ask for."""
    gateway, endpoint = call.gateway, call.endpoint
    if scope["method"] != endpoint.method:
        return _refused(errors.wrong_method(endpoint.path, endpoint.method))
    with _step(call, "key check") as span:
        key = await key_refusal(gateway, scope, call.started, call)
        if span is not None:
            span.set_attribute("llmgw.key.refused", isinstance(key, Refusal))
    if isinstance(key, Refusal):
        return _refused(key)
    limit = conf.max_body_bytes()
    declared = http.header(scope, b"content-length")
    try:
        if declared.isdigit() and int(declared) > limit:
            raise http.TooBig()
        raw = await http.read_body(call.receive, limit)
    except http.TooBig:
        return _refused(errors.too_large(limit))
    except http.Slow:
        return _refused(errors.too_slow(conf.body_seconds()))
    except http.Disconnected:
        return _GONE
    body = parse_body(raw)
    if isinstance(body, Refusal):
        return _refused(body)
    # Every value readable (finite numbers, valid strings) before anything is looked up by
    # them; the endpoint's rules once the model is known (what it takes: images or not).
    problem = None if validate.plain(raw) else validate.refusal(None, body)
    if problem is not None:
        return _refused(problem)
    name = body["model"]
    snapshot = gateway.state.get()
    entry = snapshot.catalog.entries.get(name)
    # A model the key may not use is answered as one that does not exist, the same way (the
    # same wait, the same body listing only what the key may use): no hint that it does.
    if entry is not None and key.limits is not None and not allows(key, snapshot, name):
        entry = None
    if entry is None:
        snapshot = await fresh_look(gateway, call.started)  # perhaps added a moment ago
        entry = snapshot.catalog.entries.get(name)
        if entry is not None and key.limits is not None and not allows(key, snapshot, name):
            entry = None
    if entry is None:
        names = [e.name for e in snapshot.catalog.usable() if allows(key, snapshot, e.name)]
        # Off the event loop: comparing names costs milliseconds on a large catalog.
        closest = await asyncio.to_thread(routing.entry_names_closest_first, name, names)
        # Counted under "unknown": in /metrics, not in the traffic figures.
        return _refused(errors.unknown_model(name, closest, len(names)), "unknown")
    if not entry.answers(endpoint.path):
        return _refused(errors.not_answered(endpoint.path, entry.name, entry.engine), entry.name)
    if endpoint.needs is not None and not entry.serves(endpoint.needs):
        return _refused(errors.not_served(endpoint.path, entry.name, endpoint.needs), entry.name)
    # What the engine would answer with a 500 (counted against the replica's revision, which
    # decides a canary) is the client's mistake: a 400 here, before any replica is chosen. A
    # model started with a vision projector takes images too.
    images = validate.Images() if entry.vision else None
    problem = validate.refusal(endpoint.rules, body, images, walk=False)
    if problem is not None:
        return _refused(problem)
    call.canary = entry.canary is not None
    stream = endpoint.streams and body.get("stream") is True
    remote = images.remote if images is not None else []
    return Asked(key, body, raw, entry, snapshot, stream, remote)


async def _admit(call: Call, asked: Asked) -> limits.Admission | Refusal | None:
    """Count the request against its key's and team's limits (reserving what it may use
    against their token limits), or the refusal of the first limit it would pass; None when
    nothing of theirs is counted. Where Redis counts over every machine, its word is awaited:
    the event loop serves other requests meanwhile."""
    key, snapshot = asked.key, asked.snapshot
    assert key.limits is not None
    call.unchecked = None  # the answer's headers are the decision's from here on
    team_id = key.limits.team_id
    team = snapshot.teams.get(team_id) if team_id is not None else None
    held = key.limits
    if not call.endpoint.uses_tokens:  # a count: held to its requests, not to tokens
        held = limits.without_tokens(held)
        team = limits.without_tokens(team) if team is not None else None
    if not held.counted and (team is None or not team.counted):
        return None
    gateway = call.gateway
    counters = gateway.counters
    counters.set_writer(gateway.book.writer)
    reserve = 0
    if held.tokened or (team is not None and team.tokened):
        reserve = limits.reservation(
            asked.raw, asked.body, most_tokens(asked.entry), call.endpoint.answer_limit
        )
    decided = await counters.check(key.id, held, team, snapshot.budgets, reserve=reserve)
    board = gateway.metrics
    board.limit_slots_held.set(counters.held())
    if isinstance(decided, limits.OverLimit):
        if decided.limit == "redis":
            board.limits_redis_fallback.labels("refuse").inc()
            return errors.limits_unreachable(
                decided.team if decided.subject == "team" else None, decided.retry_after
            )
        if decided.fallback:
            board.limits_redis_fallback.labels(decided.fallback).inc()
        board.limited.labels(decided.limit, decided.subject).inc()
        if decided.limit == "slots":
            return errors.limits_full(decided.figure)
        return errors.limited(
            decided.limit,
            team=decided.team if decided.subject == "team" else None,
            figure=decided.figure,
            used=decided.used,
            retry_after=decided.retry_after,
            resets_at=_utc(time.time() + decided.retry_after),
            headers=dict(decided.headers),
            reserved=decided.reserved,
        )
    if decided.fallback:
        board.limits_redis_fallback.labels(decided.fallback).inc()
    call.limit_headers = tuple((k.encode(), v.encode()) for k, v in decided.headers)
    return decided


def most_tokens(entry: routing.Entry) -> int:
    """The most tokens one answer of `entry` may have without a max_tokens (Entry.most_tokens)."""
    return entry.most_tokens


async def _route_and_send(call: Call, asked: Asked) -> Reply:
    if asked.images:
        # Fetched once the request is admitted (a key past its limits makes the gateway fetch
        # nothing), from the allowed hosts only, and sent on inline (gateway.images).
        inlined = await gateway_images.inline(asked.body, asked.images, conf.max_body_bytes())
        if isinstance(inlined, Refusal):
            return _refused(inlined)
        asked.body, asked.raw = inlined, json.dumps(inlined).encode()
    with _step(call, "route") as span:
        decision = await _decide(call, asked)
        if isinstance(decision, Reply):
            return decision
        prepared = _prepare(call, asked, decision)
        if span is not None:
            revisions = sorted({c.revision for c in prepared.decision.candidates})
            span.set_attributes(
                {
                    "llmgw.route.model": decision.model,
                    "llmgw.route.fallback_from": decision.fallback_from or "",
                    "llmgw.route.candidates": len(prepared.decision.candidates),
                    "llmgw.route.revisions": revisions,
                    "llmgw.route.prefix_blocks": len(prepared.prefix),
                }
            )
    return await _send(call, asked, prepared)


async def _decide(call: Call, asked: Asked) -> routing.Serve | Reply:
    """Decide, second part: the replicas that may serve the model (waiting, within
    LLMGW_GATEWAY_WAIT, for one to start), a fallback's or a canary's share included."""
    gateway = call.gateway
    state = gateway.state
    entry = asked.entry
    deadline = call.started + conf.wait_seconds()
    snapshot = state.get()
    state.asked_for(entry, nothing_ready=not _any_ready(entry, snapshot))
    while True:
        decision = routing.decide(
            entry,
            snapshot.replicas,
            snapshot.catalog,
            may_wait=time.monotonic() < deadline,
            unplaceable=snapshot.unplaceable,
            path=call.endpoint.path,
            needs=call.endpoint.needs,
        )
        if not isinstance(decision, routing.Wait):
            break
        state.asked_for(entry, nothing_ready=True)
        await asyncio.sleep(min(WAIT_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        snapshot = state.get()
    asked.snapshot = snapshot
    if isinstance(decision, routing.Unavailable):
        return _refused(errors.unavailable(decision.message, decision.retry_after), entry.name)
    assert isinstance(decision, routing.Serve)
    if decision.fallback_from is not None:
        gateway.metrics.fallbacks.labels(entry.name, decision.model).inc()
    return canary.share(decision, entry, random.random())


def _prepare(call: Call, asked: Asked, decision: routing.Serve) -> Prepared:
    """What the engine is sent, to which of the replicas, and the request's place in the queue."""
    body, snapshot, key = asked.body, asked.snapshot, asked.key
    target = snapshot.catalog.entries[decision.model]
    # An engine with adapters is told in every request which to apply (the one asked for, at
    # its scale; none for the base model), naming them by their place among the replica's
    # adapters: only replicas that agree on that are candidates. See Candidate.engine_lora.
    lora = decision.candidates[0].engine_lora(target.name)
    if lora is not None:
        decision = replace(
            decision,
            candidates=tuple(c for c in decision.candidates if c.engine_lora(target.name) == lora),
        )
    # The body goes on as it came, unless a fallback answers (the engine must be asked for
    # the name it serves) or the engine has adapters. A client's own "lora" field is never
    # passed on: it would apply any adapter, at any scale, under another name.
    if decision.engine_name == body["model"] and lora is None and "lora" not in body:
        payload = asked.raw
    else:
        rewritten = {name: value for name, value in body.items() if name != "lora"}
        rewritten["model"] = decision.engine_name
        if lora is not None:
            rewritten["lora"] = lora
        payload = json.dumps(rewritten).encode()
    if _progress_asked(call, asked):
        payload = proxy.with_progress(payload)  # the prompt's tokens, however the stream ends
    rename = (target.model, target.name) if target.adapter else None
    gateway = call.gateway

    async def refresh() -> tuple[routing.Candidate, ...]:
        # Whether the replica that failed is still in routing decides the retry: look
        # at the database's word after the failure, not before it.
        fresh = (await fresh_look(gateway, time.monotonic())).replicas.get(target.model, [])
        return tuple(
            c
            for c in fresh
            if c.ready and c.serves(target) and (lora is None or c.engine_lora(target.name) == lora)
        )

    # Where the prompt's beginning was computed lately, when that may save a prefill.
    prefix: list[int] = []
    read_prompt = call.endpoint.prompt
    if read_prompt is not None and target.routing == "prefix" and len(decision.candidates) > 1:
        prefix = block_hashes(read_prompt(body), decision.engine_name)
    # The key's weight among its owner's keys (gateway.fairqueue; a team's weight is read at
    # the turn).
    weight = key.limits.weight if key.limits else 1.0
    return Prepared(decision, payload, rename, refresh, prefix, weight)


async def _send(call: Call, asked: Asked, prepared: Prepared) -> Reply:
    """Its turn in the fair queue, then the request to a replica; the answer, or why none."""
    gateway = call.gateway
    decision, entry, key = prepared.decision, asked.entry, asked.key
    team_id = key.team_id
    team = asked.snapshot.teams.get(team_id) if team_id is not None else None
    turn: AbstractAsyncContextManager[Any] | None = None
    hold: routing.Hold | None = None
    if conf.fair_queue_on():
        # proxy.send's first choice of a replica takes over the slot the turn held.
        turn = gateway.queue.turn(
            model=decision.model,
            key_id=key.id,
            weight=prepared.weight,
            user_id=key.owner_id,
            team_id=team_id,
            team_weight=team.weight if team is not None else 1.0,
            user_weight=asked.snapshot.people.get(key.owner_id) if key.owner_id else None,
            candidates=decision.candidates,
            balancer=gateway.balancer,
            hangup=lambda: fairqueue.client_gone(call.receive),
        )
        waiting = time.monotonic()
        try:
            with _step(call, "queue wait"):
                hold = (await turn.__aenter__()).hold
        except (fairqueue.QueueFull, fairqueue.QueueTimeout) as exc:
            return _refused(exc.refusal(), entry.name, decision.model)
        except fairqueue.ClientGone:
            return _GONE
        finally:
            call.queued = time.monotonic() - waiting
    try:
        reply = await _sent(call, asked, prepared, hold)
    except BaseException:
        if turn is not None:
            await turn.__aexit__(None, None, None)
        raise
    reply.turn = turn
    return reply


async def _sent(call: Call, asked: Asked, prepared: Prepared, hold: routing.Hold | None) -> Reply:
    gateway, endpoint = call.gateway, call.endpoint
    decision, entry = prepared.decision, asked.entry
    engine = (
        None
        if call.span is None
        else gateway.tracer.engine_call(
            decision.engine_name, endpoint.operation, decision.candidates[0].engine
        )
    )
    sent_at = time.monotonic()
    try:
        answer = await proxy.send(
            decision,
            endpoint.path,
            prepared.payload,
            stream=asked.stream,
            balancer=gateway.balancer,
            upstream=gateway.upstream,
            tracer=gateway.tracer,
            refresh=prepared.refresh,
            prefix=prepared.prefix,
            hold=hold,
        )
    except proxy.ReplicaTimeout as exc:
        call.answered_by(exc.candidate, decision)
        log.warning("gateway: %s for %s", exc, entry.name)
        if engine is not None:
            call.gateway.tracer.end_engine_call(
                engine, str(exc), **{"llmgw.replica": exc.candidate.id}
            )
        return _refused(errors.timeout(decision.model, exc.seconds), entry.name, decision.model)
    except proxy.ReplicaGone as exc:
        call.answered_by(exc.candidate, decision)
        log.warning("gateway: %s for %s", exc, entry.name)
        if engine is not None:
            call.gateway.tracer.end_engine_call(
                engine, str(exc), **{"llmgw.replica": exc.candidate.id}
            )
        return _refused(errors.unreachable(decision.model), entry.name, decision.model)
    except BaseException:
        if engine is not None:
            call.gateway.tracer.end_engine_call(
                engine, "the request ended before the engine answered"
            )
        raise
    if engine is not None:
        # For a stream, the wait for its first chunk: the time to the first token.
        engine[0].set_attributes(
            {
                "llmgw.replica": answer.candidate.id,
                "llmgw.route.reason": gateway.balancer.reason,
                "llmgw.replica.revision": answer.candidate.revision,
                "server.address": answer.candidate.address,
                "server.port": answer.candidate.port,
                "http.response.status_code": answer.status,
                "llmgw.retried": answer.retried,
                "llmgw.time_to_first_token_seconds": round(time.monotonic() - sent_at, 6),
            }
        )
    if answer.retried:
        gateway.metrics.retries.labels(entry.name).inc()
    call.answered_by(answer.candidate, decision)
    headers = [
        (b"content-type", answer.content_type.encode()),
        (_MODEL_FIELD, decision.model.encode()),
        (_REVISION_FIELD, answer.candidate.revision.encode()),
    ]
    if answer.streaming:
        streamed = Streamed(answer, prepared.rename, engine, progress=_progress_asked(call, asked))
        if endpoint.tally is proxy.AnthropicTally and not proxy.starts_message(answer.first):
            # Its message_start, which says the prompt's tokens, will not come: the engine counts
            # them (one short request), for the message_start the gateway sends and the charge.
            streamed.prompt = await proxy.prompt_tokens(
                gateway.upstream, answer.candidate, prepared.payload
            )
        return Reply(200, b"", headers, entry.name, decision.model, stream=streamed)
    return await _whole(call, asked, prepared, answer, headers, engine)


async def _whole(
    call: Call,
    asked: Asked,
    prepared: Prepared,
    answer: proxy.Answer,
    headers: Headers,
    engine: Any,
) -> Reply:
    """A whole answer: its tokens counted, the adapter's name put back, the engine call ended."""
    gateway, decision, entry = call.gateway, prepared.decision, asked.entry
    gateway.balancer.release(answer.candidate)
    assert answer.body is not None
    body_out = answer.body
    if answer.status >= 500:
        # What the client was not told (the engine's words may name its files): the log.
        log.warning(
            "gateway: request %s for %s: the replica %s answered %d: %r",
            call.request_id,
            entry.name,
            answer.candidate.id,
            answer.status,
            answer.body[:500],
        )
    if answer.status == 200:
        prompt, completion = call.endpoint.usage(answer.body)
        if limits.answers(asked.body) > 1:
            # The engine's "usage" counts its first choice only: each other one is charged too.
            most = asked.body.get("max_completion_tokens", asked.body.get("max_tokens"))
            completion += await proxy.choice_tokens(
                gateway.upstream, answer.candidate, answer.body, most
            )
        call.tokens(decision.model, prompt, completion)
        if prepared.rename is not None:
            body_out = _renamed(body_out, *prepared.rename)
    if engine is not None:
        call.gateway.tracer.end_engine_call(
            engine, f"HTTP {answer.status}" if answer.status >= 500 else None, **call.usage()
        )
    return Reply(answer.status, body_out, headers, entry.name, decision.model)


@dataclass
class Streamed:
    """A replica's streamed answer, still to be relayed."""

    answer: proxy.Answer
    rename: tuple[str, str] | None
    engine: Any = None  # the engine call's span while tracing is on (gateway.tracing)
    # The gateway asked the engine for the prompt's progress: taken out of the stream.
    progress: bool = False
    # The prompt's tokens, where the gateway had to count them itself (a Messages stream that
    # does not start with its message_start: proxy.AnthropicTally); 0: the stream says them.
    prompt: int = 0


def _progress_asked(call: Call, asked: Asked) -> bool:
    """Whether the gateway asks the engine to report the prompt's progress (proxy.with_progress):
    for every stream of an endpoint that reports it, unless its client asked for the reports
    itself (then it gets them)."""
    return call.endpoint.progress and asked.stream and "return_progress" not in asked.body


# -- answering ---------------------------------------------------------------------------


async def _answer(call: Call, reply: Reply) -> None:
    """Tell the client, and count the request: the one place its outcome is counted. The
    request's turn in the fair queue ends after that, however it ended."""
    try:
        if reply.silent:
            return
        if reply.stream is None:
            _count(call, reply.name, reply.answered_by, reply.status)
            body = reply.body
            if reply.refusal is not None:
                refusal = reply.refusal
                api = call.endpoint.api
                body = errors.anthropic_body(refusal) if api == "anthropic" else refusal.body()
            await http.whole(call.send, reply.status, body, reply.headers, call.extra_headers())
        else:
            await _relay_stream(call, reply, reply.stream)
    finally:
        if reply.turn is not None:
            await reply.turn.__aexit__(None, None, None)


async def _relay_stream(call: Call, reply: Reply, streamed: Streamed) -> None:
    status = 200
    answer = streamed.answer
    tally = call.endpoint.tally(strip=streamed.progress, model=reply.name or "")
    tally.prompt = streamed.prompt
    try:
        assert reply.headers is not None
        await http.start(
            call.send,
            200,
            [
                *reply.headers,
                (b"cache-control", b"no-cache"),
                # A proxy in front must not hold chunks back either.
                (b"x-accel-buffering", b"no"),
                *call.limit_headers,
            ],
        )
        chunks = _chunks(answer, tally, call.endpoint.api)
        if streamed.rename is not None:
            chunks = _renaming(chunks, *streamed.rename)
        if await http.pump(chunks, call.send, call.receive, answer.close) == "broken":
            status = 502
    finally:
        answer.close()
        call.gateway.balancer.release(answer.candidate)
        call.tokens(reply.answered_by, *tally.totals())
        if streamed.engine is not None:
            broken = "the stream broke off" if status == 502 else None
            call.gateway.tracer.end_engine_call(streamed.engine, broken, **call.usage())
        # A stream's status is known only now (502 when the replica broke it off).
        _count(call, reply.name, reply.answered_by, status)


def _count(call: Call, name: str | None, answered_by: str, status: int) -> None:
    """A request is answered: count it in /metrics and in the traffic figures (and its span,
    while tracing is on)."""
    gateway = call.gateway
    if call.span is not None:
        gateway.tracer.outcome(call.span, status, name, answered_by, call.usage())
    access = gateway.access_log
    if access is not None:
        access.record(
            request_id=call.request_id,
            key_id=call.key_id,
            model=name,
            endpoint=call.endpoint.name,
            status=status,
            prompt=call.prompt,
            completion=call.completion,
            queued=call.queued,
            seconds=time.monotonic() - call.started,
        )
    if name is None:
        return  # refused before it named a model it may use: not counted
    gateway.metrics.requests.labels(name, answered_by, call.endpoint.name, str(status)).inc()
    if name != "unknown":
        gateway.book.record(
            model=name,
            key_id=call.key_id,
            status=status,
            seconds=time.monotonic() - call.started,
            prompt=call.prompt,
            completion=call.completion,
            revision=call.revision,
            canary=call.canary,
            request_id=call.request_id,
        )


async def _chunks(answer: proxy.Answer, tally: proxy.StreamTally, api: str) -> AsyncIterator[bytes]:
    """The stream's chunks, counted (and the gateway's own reports taken out) as they pass."""
    first = tally.feed(answer.first)
    if first:
        yield first
    # The stream after `first`, as it arrives, each wait bounded by the upstream timeout (the
    # request's read timeout).
    connection, timeout = answer.connection, answer.timeout
    assert connection is not None
    try:
        while chunk := await connection.read(timeout):
            passed = tally.feed(chunk)
            if passed:
                yield passed
        rest = tally.end()
        if rest:
            yield rest
    except proxy.STREAM_ERRORS as exc:
        if answer.closed:
            return  # closed here, because the client went away
        # Too late to retry or to change the status: say so in the stream, in the shape the
        # API's clients raise as an error, rather than end it as though it were complete.
        log.warning("gateway: the replica %s broke off a stream: %s", answer.candidate.id, exc)
        yield errors.stream_broken(api)
        raise http.Broken() from exc


def _renamed(body: bytes, served: str, asked: str) -> bytes:
    """``"model":"<served>"`` made ``"model":"<asked>"`` (the engines write compact JSON)."""
    return body.replace(
        b'"model":' + json.dumps(served).encode(), b'"model":' + json.dumps(asked).encode()
    )


async def _renaming(chunks: AsyncIterator[bytes], served: str, asked: str) -> AsyncIterator[bytes]:
    """The stream with the engine's model name replaced, a whole line at a time (an event's
    JSON is one line; a chunk may end inside one)."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        cut = pending.rfind(b"\n") + 1
        if cut:
            yield _renamed(pending[:cut], served, asked)
            pending = pending[cut:]
    if pending:
        yield _renamed(pending, served, asked)


def _any_ready(entry: routing.Entry, snapshot: Snapshot) -> bool:
    return any(c.ready and c.serves(entry) for c in snapshot.replicas.get(entry.model, []))


ROUTES: dict[str, Handler] = routes(ENDPOINTS)
