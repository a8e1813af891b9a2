"""The gateway: a lean ASGI application for /v1/ and /metrics, run by uvicorn's workers.

    uvicorn gateway.asgi:application --workers N --loop uvloop --http httptools

Each worker process serves thousands of streams at once on one event loop. A
request reads no database: keys, catalog and replicas are in memory (see
gateway.state), the choice of replica counts every worker's requests in flight
(gateway.load), engines are reached over pooled connections (gateway.proxy).

Why not Django's own async views: Django shares the models, settings and
services with this module, but its request handling (middleware, URL resolving,
request and response objects) costs more CPU per request than everything else the
gateway does together (bench/gateway.py measures both), and its ASGI handler
consumes a streamed file answer whole before sending it, which the mirror's
weight files cannot afford. So the gateway is plain ASGI, and everything else
(console, admin, /api/v1/, /mirror/) stays a WSGI application under gunicorn:
when LLMGW_GATEWAY_FORWARD_TO names it, the gateway passes every other request
there unchanged, so one address serves both (the run command does this).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
django.setup()

import aiohttp  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from multidict import CIMultiDict  # noqa: E402
from yarl import URL  # noqa: E402

from catalog.config import ConfigError, current_config  # noqa: E402

from . import (  # noqa: E402
    canary,
    conf,
    errors,
    fairqueue,
    limits,
    proxy,
    routing,
    traffic,
    validate,
)
from .errors import Refusal  # noqa: E402
from .forwarded import GATEWAY_SECRET_HEADER, gateway_secret  # noqa: E402
from .load import SharedLoad  # noqa: E402
from .metrics import metrics  # noqa: E402
from .models import hash_key  # noqa: E402
from .prefix import PrefixTable, block_hashes, prompt_text  # noqa: E402
from .redislimits import RedisLimits  # noqa: E402
from .services import KEY_PREFIX  # noqa: E402
from .state import POLL_SECONDS, KeyState, Snapshot, state  # noqa: E402

log = logging.getLogger("llmgw.gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MODEL_HEADER = "X-LLMGW-Model"
# The weights that answered (fleet.specs.weights_revision): old or new during a canary update.
REVISION_HEADER = "X-LLMGW-Revision"
REQUEST_ID_HEADER = "X-Request-ID"
# How often a request waiting for a replica looks at the (in-memory) state again.
WAIT_POLL_SECONDS = 0.1
# How long a request for something unknown waits for the state to be looked at again.
FRESH_LOOK_SECONDS = 2 * POLL_SECONDS + 0.5
# JSON bodies: a depth no OpenAI request comes near, and integers of sane size.
MAX_DEPTH = 64
MAX_INT_DIGITS = 40

_JSON = [(b"content-type", b"application/json")]


# -- the application ---------------------------------------------------------------------


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    kind = scope["type"]
    if kind == "http":
        path: str = scope["path"]
        if path.startswith("/v1/"):
            handler = _ROUTES.get(path)
            if handler is None:
                await _refuse(send, _no_such_endpoint(path))
            else:
                await handler(scope, receive, send)
        elif path == "/metrics":
            await _metrics(scope, send)
        else:
            await _forward(scope, receive, send)
    elif kind == "lifespan":
        await _lifespan(receive, send)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await asyncio.to_thread(start_process)
            except ConfigError as exc:
                # The same message web, worker and beat stop with; no traceback for a bad file.
                log.error("llmgw gateway: cannot start: %s", exc)
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
            except Exception as exc:
                log.exception("gateway: could not start")
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await proxy.upstream.close()
            await _web.close()
            await asyncio.to_thread(stop_process)
            await send({"type": "lifespan.shutdown.complete"})
            return


def start_process() -> None:
    """This process's state: the routing snapshot, its refresher, shared load, metrics."""
    # Bad settings stop the gateway here, not at its first request.
    conf.wait_seconds(), conf.upstream_timeout(), conf.metrics_open(), conf.body_seconds()
    conf.max_head_bytes(), conf.max_headers(), conf.head_seconds(), conf.forward_memory_bytes()
    conf.max_connections(), conf.queue_timeout(), conf.queue_max(), conf.fair_queue_on()
    conf.limits_redis_url()
    current_config()  # and a server.yaml that does not validate (ConfigError)
    routing.balancer = routing.Balancer(
        SharedLoad(settings.VAR_DIR / "gateway-load"),
        PrefixTable(settings.VAR_DIR / "gateway-prefix"),
    )
    if limits.counters is not None:
        limits.counters.close()
    limits.counters = limits.SharedCounters(
        settings.VAR_DIR / "gateway-limits", writer=traffic.book.writer
    )
    redis_url = conf.limits_redis_url()
    if redis_url:
        board = metrics()
        limits.counters.remote = RedisLimits(
            redis_url,
            on_error=board.limits_redis_errors.inc,
            on_drop=board.limits_redis_dropped.inc,
        )
    fairqueue.fair_queue.close()
    fairqueue.fair_queue = fairqueue.FairQueue(settings.VAR_DIR / "gateway-queue")
    fairqueue.fair_queue.on_depth = _queue_depth
    fairqueue.fair_queue.on_wait = _queue_wait
    metrics()
    try:
        state.reload()
    finally:
        connection.close()  # this thread's: the refresher has its own
    state.start()


def _queue_depth(model: str, depth: int) -> None:
    metrics().queue_depth.labels(model).set(depth)


def _queue_wait(model: str, seconds: float, outcome: str) -> None:
    metrics().queue_seconds.labels(model, outcome).observe(seconds)
    # And in the traffic figures, for the model page and the API (a request that did not
    # queue is not written there).
    traffic.book.record_wait(model=model, seconds=seconds, outcome=outcome)


def stop_process() -> None:
    state.stop()
    try:
        traffic.book.flush()  # the last seconds' figures
    except Exception:
        log.exception("gateway: could not write the last traffic figures")
    finally:
        connection.close()
    routing.balancer.load.close()
    routing.balancer.prefixes.close()
    fairqueue.fair_queue.close()
    if limits.counters is not None:
        # After the flush: until its file goes, the others count this process's tokens by it.
        limits.counters.close()


# -- answers ------------------------------------------------------------------------------


async def _answer(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    books = _request.get()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                *(headers or _JSON),
                *(_limit_headers(books) if books is not None else ()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _refuse(send: Send, refusal: Refusal) -> None:
    headers = [*_JSON, *((k.lower().encode(), v.encode()) for k, v in refusal.headers.items())]
    await _answer(send, refusal.status, refusal.body(), headers)


def _no_such_endpoint(path: str) -> Refusal:
    return errors.openai_error(
        404,
        f"There is no endpoint {path}. The gateway serves GET /v1/models, POST "
        "/v1/chat/completions, /v1/completions and /v1/embeddings.",
        code="unknown_url",
    )


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


# -- keys ---------------------------------------------------------------------------------


async def _fresh_look(since: float) -> Snapshot:
    """The state once the refresher has looked at the database after `since` (bounded wait)."""
    deadline = time.monotonic() + FRESH_LOOK_SECONDS
    while not state.looked_since(since) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return state.get()


async def _key_refusal(scope: Scope, arrived: float) -> KeyState | Refusal:
    """The request's gateway key when it is active (and not expired); else the 401 to answer
    with."""
    scheme, _, secret = _header(scope, b"authorization").partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        return errors.missing_key()
    if not secret.startswith(KEY_PREFIX):
        return errors.invalid_key(revoked=False)  # not one of ours
    digest = hash_key(secret)
    key = state.get().keys.get(digest)
    if key is None:
        # Perhaps created a moment ago: wait for the next look rather than refuse it.
        key = (await _fresh_look(arrived)).keys.get(digest)
    if key is None or not key.active:
        return errors.invalid_key(revoked=key is not None)
    expires_at = key.limits.expires_at if key.limits is not None else None
    if expires_at is not None and time.time() >= expires_at:
        metrics().limited.labels("expired", "key").inc()
        return errors.expired_key(_utc(expires_at))
    state.key_used(key.id)
    books = _request.get()
    if books is not None:
        books.key_id = key.id
        if key.limits is not None:
            books.unchecked = key
    return key


def _utc(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _allows(key: KeyState, snapshot: Snapshot, name: str) -> bool:
    """Whether the key (and its team) may ask for the model or adapter `name`."""
    if key.limits is None:
        return True
    if not key.limits.allows(name):
        return False
    team = snapshot.teams.get(key.limits.team_id) if key.limits.team_id is not None else None
    return team is None or team.allows(name)


# -- /v1/models ---------------------------------------------------------------------------


async def _models(scope: Scope, receive: Receive, send: Send) -> None:
    arrived = time.monotonic()
    if scope["method"] != "GET":
        await _refuse(send, errors.wrong_method("/v1/models", "GET"))
        return
    key = await _key_refusal(scope, arrived)
    if isinstance(key, Refusal):
        await _refuse(send, key)
        return
    snapshot = state.get()
    data = [
        {
            "id": entry.name,
            "object": "model",
            "created": entry.created,
            "owned_by": entry.owner or "llmgw",
            # As vLLM names them: an adapter's parent is the model whose replicas serve it.
            "root": entry.model,
            "parent": entry.model if entry.adapter else None,
        }
        for entry in sorted(snapshot.catalog.usable(), key=lambda e: e.name)
        # A key limited to some models sees only those.
        if key.limits is None or _allows(key, snapshot, entry.name)
    ]
    await _answer(send, 200, json.dumps({"object": "list", "data": data}).encode())


# -- the generating endpoints ------------------------------------------------------------


class _TooBig(Exception):
    pass


class _Disconnected(Exception):
    pass


class _Slow(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes:
    """The whole body, up to `limit` bytes (_TooBig past it); a client that pauses longer than
    conf.body_seconds() between two pieces is _Slow."""
    chunks: list[bytes] = []
    size = 0
    pause = conf.body_seconds()
    while True:
        try:
            async with asyncio.timeout(pause):
                message = await receive()
        except TimeoutError:
            raise _Slow() from None
        if message["type"] == "http.disconnect":
            raise _Disconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooBig()
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _sane_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _NotSane(f"a number with more than {MAX_INT_DIGITS} digits")
    return int(text)


def _no_constant(text: str) -> float:
    raise _NotSane(f"{text}, which JSON does not have")


class _NotSane(Exception):
    pass


def parse_body(raw: bytes) -> dict[str, Any] | Refusal:
    """The request's JSON object, or a 400 saying what is wrong with it (never an exception)."""
    try:
        body = json.loads(raw, parse_int=_sane_int, parse_constant=_no_constant)
    except _NotSane as exc:
        return errors.bad_request(f"The request body has {exc}; send ordinary JSON numbers.")
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


def _generating(path: str, endpoint: str, *, streams: bool) -> Callable[..., Awaitable[None]]:
    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        await _relay(scope, receive, send, path, endpoint, streams=streams)

    return handle


@dataclass
class _Request:
    """What one generating request leaves for the traffic figures (gateway.traffic), gathered
    as it goes: its key, when it started, its tokens. Lives in the request's own task."""

    started: float
    # Sent back as X-Request-ID and named in the gateway's log lines about the request.
    request_id: str = field(default_factory=lambda: os.urandom(8).hex())
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


_request: ContextVar[_Request | None] = ContextVar("llmgw_request", default=None)


async def _relay(
    scope: Scope, receive: Receive, send: Send, path: str, endpoint: str, *, streams: bool
) -> None:
    started = time.monotonic()
    _request.set(_Request(started))
    if scope["method"] != "POST":
        await _refuse(send, errors.wrong_method(path, "POST"))
        return
    key = await _key_refusal(scope, started)
    if isinstance(key, Refusal):
        await _refuse(send, key)
        return
    limit = conf.max_body_bytes()
    declared = _header(scope, b"content-length")
    try:
        if declared.isdigit() and int(declared) > limit:
            raise _TooBig()
        raw = await _read_body(receive, limit)
    except _TooBig:
        await _refuse(send, errors.too_large(limit))
        return
    except _Slow:
        await _refuse(send, errors.too_slow(conf.body_seconds()))
        return
    except _Disconnected:
        return
    body = parse_body(raw)
    if isinstance(body, Refusal):
        await _refuse(send, body)
        return
    # What the engine would answer with a 500 (counted against the replica's revision, which
    # decides a canary) is the client's mistake: a 400 here, before any replica is chosen.
    problem = validate.refusal(endpoint, body)
    if problem is not None:
        await _refuse(send, problem)
        return
    name = body["model"]
    snapshot = state.get()
    entry = snapshot.catalog.entries.get(name)
    # A model the key may not use is answered as one that does not exist, the same way (the
    # same wait, the same body listing only what the key may use): no hint that it does.
    if entry is not None and key.limits is not None and not _allows(key, snapshot, name):
        entry = None
    if entry is None:
        snapshot = await _fresh_look(started)  # perhaps added a moment ago
        entry = snapshot.catalog.entries.get(name)
        if entry is not None and key.limits is not None and not _allows(key, snapshot, name):
            entry = None
    if entry is None:
        names = [e.name for e in snapshot.catalog.usable() if _allows(key, snapshot, e.name)]
        _count("unknown", "", endpoint, 404)
        # Off the event loop: comparing names costs milliseconds on a large catalog.
        closest = await asyncio.to_thread(routing.entry_names_closest_first, name, names)
        await _refuse(send, errors.unknown_model(name, closest, len(names)))
        return
    books = _request.get()
    if books is not None:
        books.canary = entry.canary is not None
    admission = None
    if key.limits is not None:
        admitted = _admit(key, snapshot)
        if isinstance(admitted, Refusal):
            _count(entry.name, "", endpoint, admitted.status)
            await _refuse(send, admitted)
            return
        admission = admitted
    stream = streams and body.get("stream") is True
    board = metrics()
    board.in_flight.labels(entry.name).inc()
    try:
        await _route_and_send(send, receive, entry, body, raw, path, endpoint, stream, started, key)
    finally:
        if admission is not None:
            # However the request ended (answered, refused, client gone, engine broken).
            _release(admission)
        board.in_flight.labels(entry.name).dec()
        board.latency.labels(entry.name, endpoint).observe(time.monotonic() - started)


def _admit(key: KeyState, snapshot: Snapshot) -> limits.Admission | Refusal | None:
    """Count the request against its key's and team's limits, or the refusal of the first
    limit it would pass; None when nothing of theirs is counted."""
    assert key.limits is not None
    books = _request.get()
    if books is not None:
        books.unchecked = None  # the answer's headers are the decision's from here on
    team_id = key.limits.team_id
    team = snapshot.teams.get(team_id) if team_id is not None else None
    if not key.limits.counted and (team is None or not team.counted):
        return None
    counters = limits.shared_counters()
    counters.set_writer(traffic.book.writer)
    decided = counters.admit(key.id, key.limits, team, snapshot.budgets)
    board = metrics()
    board.limit_slots_held.set(counters.held())
    if isinstance(decided, limits.Refused):
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
        )
    if books is not None:
        books.limit_headers = tuple((k.encode(), v.encode()) for k, v in decided.headers)
    return decided


def _limit_headers(books: _Request) -> tuple[tuple[bytes, bytes], ...]:
    """The x-ratelimit-* headers of the request's answer: the admission's, or, for an answer
    before its limits were checked (a bad body, an unknown model), where they stand now."""
    key = books.unchecked
    if key is None or key.limits is None:
        return books.limit_headers
    books.unchecked = None
    team_id = key.limits.team_id
    team = state.get().teams.get(team_id) if team_id is not None else None
    found = limits.shared_counters().peek(key.id, key.limits, team)
    return tuple((k.encode(), v.encode()) for k, v in found)


def _release(admission: limits.Admission) -> None:
    books = _request.get()
    admission.release(books.prompt + books.completion if books is not None else 0)


async def _route_and_send(
    send: Send,
    receive: Receive,
    entry: routing.Entry,
    body: dict[str, Any],
    raw: bytes,
    path: str,
    endpoint: str,
    stream: bool,
    started: float,
    key: KeyState,
) -> None:
    deadline = started + conf.wait_seconds()
    snapshot = state.get()
    state.asked_for(entry, nothing_ready=not _any_ready(entry, snapshot))
    while True:
        decision = routing.decide(
            entry,
            snapshot.replicas,
            snapshot.catalog,
            may_wait=time.monotonic() < deadline,
            unplaceable=snapshot.unplaceable,
        )
        if not isinstance(decision, routing.Wait):
            break
        state.asked_for(entry, nothing_ready=True)
        await asyncio.sleep(min(WAIT_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        snapshot = state.get()

    if isinstance(decision, routing.Unavailable):
        _count(entry.name, "", endpoint, 503)
        await _refuse(send, errors.unavailable(decision.message, decision.retry_after))
        return
    assert isinstance(decision, routing.Serve)
    if decision.fallback_from is not None:
        metrics().fallbacks.labels(entry.name, decision.model).inc()
    decision = canary.share(decision, entry, random.random())

    target = snapshot.catalog.entries[decision.model]
    # An engine with adapters is told in every request which to apply (the one asked for, at
    # its scale; none for the base model), naming them by their place among the replica's
    # adapters: only replicas that agree on that are candidates. See llmgw.engine.lora_request.
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
        payload = raw
    else:
        rewritten = {key: value for key, value in body.items() if key != "lora"}
        rewritten["model"] = decision.engine_name
        if lora is not None:
            rewritten["lora"] = lora
        payload = json.dumps(rewritten).encode()
    # The engine names its base model in answers; an adapter's answer names the adapter.
    rename = (target.model, target.name) if target.adapter else None

    async def refresh() -> tuple[routing.Candidate, ...]:
        # Whether the replica that failed is still in routing decides the retry: look
        # at the database's word after the failure, not before it.
        fresh = (await _fresh_look(time.monotonic())).replicas.get(target.model, [])
        return tuple(
            c
            for c in fresh
            if c.ready and c.serves(target) and (lora is None or c.engine_lora(target.name) == lora)
        )

    # Where the prompt's beginning was computed lately, when that may save a prefill.
    prefix: list[int] = []
    if target.routing == "prefix" and len(decision.candidates) > 1:
        prefix = block_hashes(prompt_text(body), decision.engine_name)
    # A team's keys share the team's weight (gateway.fairqueue).
    team_id = key.team_id
    team = snapshot.teams.get(team_id) if team_id is not None else None
    weight = team.weight if team is not None else key.limits.weight if key.limits else 1.0
    async with contextlib.AsyncExitStack() as held:
        if conf.fair_queue_on():
            try:
                # Nothing is awaited between the turn and proxy.send's choice of a replica.
                await held.enter_async_context(
                    fairqueue.fair_queue.turn(
                        model=decision.model,
                        key_id=key.id,
                        weight=weight,
                        team_id=team_id,
                        candidates=decision.candidates,
                        balancer=routing.balancer,
                        hangup=lambda: fairqueue.client_gone(receive),
                    )
                )
            except (fairqueue.QueueFull, fairqueue.QueueTimeout) as exc:
                refusal = exc.refusal()
                _count(entry.name, decision.model, endpoint, refusal.status)
                await _refuse(send, refusal)
                return
            except fairqueue.ClientGone:
                return
        try:
            answer = await proxy.send(
                decision,
                path,
                payload,
                stream=stream,
                balancer=routing.balancer,
                refresh=refresh,
                prefix=prefix,
            )
        except proxy.ReplicaTimeout as exc:
            _answered_by(exc.candidate, decision)
            log.warning("gateway: %s for %s", exc, entry.name)
            _count(entry.name, decision.model, endpoint, 504)
            await _refuse(send, errors.timeout(decision.model, exc.seconds))
            return
        except proxy.ReplicaGone as exc:
            _answered_by(exc.candidate, decision)
            log.warning("gateway: %s for %s", exc, entry.name)
            _count(entry.name, decision.model, endpoint, 502)
            await _refuse(send, errors.unreachable(decision.model))
            return
        if answer.retried:
            metrics().retries.labels(entry.name).inc()
        _answered_by(answer.candidate, decision)

        books = _request.get()
        request_id = books.request_id if books is not None else ""
        model_header = (MODEL_HEADER.lower().encode(), decision.model.encode())
        revision_header = (REVISION_HEADER.lower().encode(), answer.candidate.revision.encode())
        id_header = (REQUEST_ID_HEADER.lower().encode(), request_id.encode())
        if not answer.streaming:
            routing.balancer.release(answer.candidate)
            assert answer.body is not None
            body_out = answer.body
            if answer.status >= 500:
                # What the client was not told (the engine's words may name its files): the log.
                log.warning(
                    "gateway: request %s for %s: the replica %s answered %d: %r",
                    request_id,
                    entry.name,
                    answer.candidate.id,
                    answer.status,
                    answer.body[:500],
                )
            if answer.status == 200:
                _tokens(decision.model, *proxy.usage_of(answer.body))
                if rename is not None:
                    body_out = _renamed(body_out, *rename)
            _count(entry.name, decision.model, endpoint, answer.status)
            await _answer(
                send,
                answer.status,
                body_out,
                [
                    (b"content-type", answer.content_type.encode()),
                    model_header,
                    revision_header,
                    id_header,
                ],
            )
            return

        tally = proxy.StreamTally()
        status = 200
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", answer.content_type.encode()),
                        model_header,
                        revision_header,
                        id_header,
                        (b"cache-control", b"no-cache"),
                        # A proxy in front must not hold chunks back either.
                        (b"x-accel-buffering", b"no"),
                        *(books.limit_headers if books is not None else ()),
                    ],
                }
            )
            chunks = _chunks(answer, tally)
            if rename is not None:
                chunks = _renaming(chunks, *rename)
            outcome = await _pump(chunks, send, receive, answer.close)
            if outcome == "broken":
                status = 502
        finally:
            answer.close()
            routing.balancer.release(answer.candidate)
            _tokens(decision.model, *tally.totals())
            _count(entry.name, decision.model, endpoint, status)


async def _chunks(answer: proxy.Answer, tally: proxy.StreamTally) -> AsyncIterator[bytes]:
    tally.feed(answer.first)
    yield answer.first
    try:
        async for chunk in answer.rest():
            tally.feed(chunk)
            yield chunk
    except proxy.STREAM_ERRORS as exc:
        if answer.closed:
            return  # closed here, because the client went away
        # Too late to retry or to change the status: say so in the stream, in the shape
        # OpenAI clients raise as an error, rather than end it as though it were complete.
        log.warning("gateway: the replica %s broke off a stream: %s", answer.candidate.id, exc)
        error = {
            "message": "The replica broke off the answer; try again.",
            "type": "server_error",
            "code": "stream_broken",
        }
        yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
        raise _Broken() from exc


class _Broken(Exception):
    pass


def _renamed(body: bytes, served: str, asked: str) -> bytes:
    """``"model":"<served>"`` made ``"model":"<asked>"`` (llama-server writes compact JSON)."""
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


async def _pump(
    chunks: AsyncIterator[bytes], send: Send, receive: Receive, on_disconnect: Callable[[], None]
) -> str:
    """Send the chunks as they come; when the client hangs up, call `on_disconnect` at once
    (closing the upstream connection, which makes the engine stop) and stop.

    Returns "done", "gone" (the client left) or "broken" (the source broke off)."""
    gone = asyncio.Event()

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                on_disconnect()
                return

    watcher = asyncio.ensure_future(watch())
    outcome = "done"
    try:
        async for chunk in chunks:
            if gone.is_set():
                break
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except _Broken:
        outcome = "broken"
    except OSError:
        gone.set()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if gone.is_set():
        return "gone"
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return outcome


def _any_ready(entry: routing.Entry, snapshot: Snapshot) -> bool:
    return any(c.ready and c.serves(entry) for c in snapshot.replicas.get(entry.model, []))


def _count(name: str, answered_by: str, endpoint: str, status: int) -> None:
    """A request is answered: count it in /metrics and in the traffic figures."""
    metrics().requests.labels(name, answered_by, endpoint, str(status)).inc()
    books = _request.get()
    if books is not None and name != "unknown":
        traffic.book.record(
            model=name,
            key_id=books.key_id,
            status=status,
            seconds=time.monotonic() - books.started,
            prompt=books.prompt,
            completion=books.completion,
            revision=books.revision,
            canary=books.canary,
        )


def _answered_by(candidate: routing.Candidate, decision: routing.Serve) -> None:
    """The request's figures count for the revision of the replica that answered it."""
    books = _request.get()
    if books is not None and decision.fallback_from is None:
        books.revision = candidate.revision


def _tokens(model: str, prompt: int, completion: int) -> None:
    books = _request.get()
    if books is not None:
        books.prompt += prompt
        books.completion += completion
    board = metrics()
    if prompt:
        board.tokens.labels(model, "prompt").inc(prompt)
    if completion:
        board.tokens.labels(model, "completion").inc(completion)


_ROUTES: dict[str, Callable[[Scope, Receive, Send], Awaitable[None]]] = {
    "/v1/models": _models,
    "/v1/chat/completions": _generating("/v1/chat/completions", "chat", streams=True),
    "/v1/completions": _generating("/v1/completions", "completions", streams=True),
    "/v1/embeddings": _generating("/v1/embeddings", "embeddings", streams=False),
}


# -- /metrics -----------------------------------------------------------------------------


def metrics_refusal(authorization: str) -> Refusal | None:
    """None when this scrape may read /metrics (see LLMGW_METRICS_TOKEN, LLMGW_METRICS_OPEN)."""
    token = conf.metrics_token()
    if token is None:
        if conf.metrics_open():
            return None
        return errors.openai_error(
            403,
            "/metrics is closed: set LLMGW_METRICS_TOKEN and have Prometheus send it "
            "(authorization: {credentials: TOKEN}), or set LLMGW_METRICS_OPEN=true to let "
            "anyone who can reach the gateway read it.",
            code="metrics_closed",
            kind="permission_error",
        )
    scheme, _, sent = authorization.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), token.encode()):
        return None
    return errors.openai_error(
        401,
        "/metrics needs the scrape token: send 'Authorization: Bearer TOKEN' with the value of "
        "LLMGW_METRICS_TOKEN.",
        code="invalid_metrics_token",
        headers={"WWW-Authenticate": "Bearer"},
    )


async def _metrics(scope: Scope, send: Send) -> None:
    if scope["method"] not in ("GET", "HEAD"):
        await _refuse(send, errors.wrong_method("/metrics", "GET"))
        return
    refusal = metrics_refusal(_header(scope, b"authorization"))
    if refusal is not None:
        await _refuse(send, refusal)
        return
    from .metrics import exposition

    text, content_type = await asyncio.to_thread(exposition, state.get().engines)
    await _answer(send, 200, text, [(b"content-type", content_type.encode())])


# -- everything else: the web process -----------------------------------------------------

_HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
}

# Headers by which a client would say who it is or how it came: only the gateway tells the web
# that, from the peer it saw (or a trusted proxy's word, see LLMGW_TRUSTED_PROXIES), so a
# client's own are dropped. So is every name with an underscore: Django's WSGI environ cannot
# tell X_Forwarded_For from X-Forwarded-For, and gunicorn takes a SCRIPT_NAME header as the
# script prefix.
_CLIENT_MAY_NOT_SAY = {
    b"expect",  # the gateway has read the body already: the web must not answer 100 Continue
    b"forwarded",
    b"x-real-ip",
    b"x-client-ip",
    b"true-client-ip",
    b"x-url-scheme",
    b"front-end-https",
    GATEWAY_SECRET_HEADER.lower().encode(),
}


def forwarded_headers(scope: Scope) -> list[tuple[str, str]]:
    """The headers the web process gets: the client's, less hop-by-hop ones and any that say
    who the client is, plus the gateway's own word on that."""
    headers = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in scope["headers"]
        if k not in _HOP_BY_HOP
        and k not in _CLIENT_MAY_NOT_SAY
        and not k.startswith(b"x-forwarded-")
        and b"_" not in k
    ]
    client = scope.get("client")
    if client:
        headers.append(("X-Forwarded-For", str(client[0])))
    headers.append(("X-Forwarded-Proto", scope.get("scheme", "http")))
    secret = gateway_secret()
    if secret:
        headers.append((GATEWAY_SECRET_HEADER, secret))
    return headers


class _Web:
    """Pooled connections to the web process."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=proxy.IDLE_SECONDS),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


_web = _Web()


class _Budget:
    """Bytes of request bodies for the web held in this process, all clients together: a body
    is read whole before it is passed on (a slow client then never holds a web thread), so
    this bounds what clients not yet known can pin."""

    def __init__(self) -> None:
        self.held = 0

    def take(self, size: int) -> Callable[[], None] | None:
        """Hold `size` bytes; None when there is no room. Returns what gives them back (once,
        however often it is called)."""
        if self.held + size > conf.forward_memory_bytes():
            return None
        self.held += size
        metrics().forward_held.inc(size)
        given = False

        def give() -> None:
            nonlocal given
            if not given:
                given = True
                self.held -= size
                metrics().forward_held.dec(size)

        return give


_forward_budget = _Budget()


async def _read_forwarded_body(
    scope: Scope, receive: Receive, send: Send, limit: int
) -> bytes | None:
    """The request's body, at most `limit` bytes; None when the client was answered instead
    (413, 408) or went away."""
    try:
        return await _read_body(receive, limit)
    except _TooBig:
        await _refuse(send, errors.too_large(limit))
    except _Slow:
        await _refuse(send, errors.too_slow(conf.body_seconds()))
    except _Disconnected:
        pass
    return None


async def _forward(scope: Scope, receive: Receive, send: Send) -> None:
    """Pass the request to the web process, its body read whole first (within the web's limit
    and this process's budget), and its answer back as it comes."""
    target = conf.forward_to()
    if target is None:
        await _refuse(
            send,
            errors.openai_error(
                404,
                "This address serves the gateway only (/v1/ and /metrics).",
                code="unknown_url",
            ),
        )
        return
    limit = conf.max_body_bytes()  # what the web takes: more would only be refused there
    declared = _header(scope, b"content-length")
    if declared.isdigit() and int(declared) > limit:
        await _refuse(send, errors.too_large(limit))
        return
    # Held from before the read until the web has the body: the declared length, or the
    # limit when the body comes in chunks of unknown total.
    if declared.isdigit():
        held = int(declared)
    else:
        held = limit if _header(scope, b"transfer-encoding") else 0
    give_back = _forward_budget.take(held)
    if give_back is None:
        await _refuse(send, errors.busy(1))
        return
    try:
        await _forward_held(scope, receive, send, target, limit, give_back)
    finally:
        give_back()


async def _forward_held(
    scope: Scope,
    receive: Receive,
    send: Send,
    target: str,
    limit: int,
    give_back: Callable[[], None],
) -> None:
    body = await _read_forwarded_body(scope, receive, send, limit)
    if body is None:
        return
    headers = forwarded_headers(scope)
    url = target + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    try:
        response = await _web.session().request(
            scope["method"],
            URL(url, encoded=True),
            data=body or None,
            headers=CIMultiDict(headers),
            allow_redirects=False,
        )
    except (aiohttp.ClientError, OSError) as exc:
        give_back()
        log.warning("gateway: the web process did not answer: %s", exc)
        await _refuse(
            send,
            errors.openai_error(
                502,
                "The web process behind the gateway did not answer; try again in a moment.",
                code="web_unreachable",
                kind="server_error",
            ),
        )
        return
    give_back()  # the web has the body: an answer streamed back holds none of it
    try:
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [
                    (k.lower(), v) for k, v in response.raw_headers if k.lower() not in _HOP_BY_HOP
                ],
            }
        )

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, OSError):
                if not response.closed:
                    raise

        await _pump(chunks(), send, receive, response.close)
    finally:
        response.close()
