"""The OpenAI-compatible endpoints under /v1/, and /metrics.

A request costs a constant few queries: its key (one), the replicas of the model
asked for and of its fallbacks (one), and now and then a write of the key's last
use or the model's idle clock. The catalog comes from this process's copy
(routing.CatalogCache). Streams are passed on chunk by chunk as the replica sends
them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from . import conf, errors, proxy, routing, services
from .metrics import metrics

log = logging.getLogger("llmgw.gateway")

# How often a request waiting for a replica looks again.
WAIT_POLL_SECONDS = 0.3
MODEL_HEADER = "X-LLMGW-Model"


def _key_error(request: HttpRequest) -> HttpResponse | None:
    """None when the request carries an active gateway key; else the 401 to answer with."""
    header = request.headers.get("Authorization", "")
    scheme, _, secret = header.partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        return errors.missing_key()
    key = services.key_authenticate(secret)
    if key is None:
        return errors.invalid_key(revoked=services.key_was_revoked(secret))
    return None


def _gateway_view(
    view: Callable[[HttpRequest], HttpResponseBase],
) -> Callable[[HttpRequest], HttpResponseBase]:
    """An OpenAI endpoint: no CSRF (clients send keys, not cookies), a gateway key required."""

    def wrapped(request: HttpRequest) -> HttpResponseBase:
        refusal = _key_error(request)
        return refusal if refusal is not None else view(request)

    wrapped.__name__ = view.__name__
    wrapped.__doc__ = view.__doc__
    return csrf_exempt(wrapped)


# -- /v1/models --------------------------------------------------------------------------


@_gateway_view
def models(request: HttpRequest) -> HttpResponse:
    """The models and adapters a key may ask for, in OpenAI's list shape."""
    if request.method != "GET":
        return _wrong_method("/v1/models", "GET")
    catalog = routing.catalog_cache.get()
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
        for entry in sorted(catalog.usable(), key=lambda e: e.name)
    ]
    return JsonResponse({"object": "list", "data": data})


# -- the generating endpoints ------------------------------------------------------------


@_gateway_view
def chat_completions(request: HttpRequest) -> HttpResponseBase:
    return _relay(request, "/v1/chat/completions", "chat", streams=True)


@_gateway_view
def completions(request: HttpRequest) -> HttpResponseBase:
    return _relay(request, "/v1/completions", "completions", streams=True)


@_gateway_view
def embeddings(request: HttpRequest) -> HttpResponseBase:
    return _relay(request, "/v1/embeddings", "embeddings", streams=False)


def _wrong_method(path: str, method: str) -> HttpResponse:
    return errors.openai_error(
        405,
        f"{path} takes {method} requests.",
        code="method_not_allowed",
        headers={"Allow": method},
    )


def _read_body(request: HttpRequest) -> dict[str, Any] | HttpResponse:
    try:
        raw = request.body
    except RequestDataTooBig:
        return errors.openai_error(
            413, "The request body is too large for this gateway.", code="request_too_large"
        )
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return errors.bad_request("The request body is not JSON; send a JSON object.")
    if not isinstance(body, dict):
        return errors.bad_request("The request body must be a JSON object.")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        return errors.bad_request(
            "Say which model should answer: the body needs a 'model' (GET /v1/models lists them).",
            param="model",
        )
    return body


def _relay(request: HttpRequest, path: str, endpoint: str, *, streams: bool) -> HttpResponseBase:
    if request.method != "POST":
        return _wrong_method(path, "POST")
    started = time.monotonic()
    body = _read_body(request)
    if isinstance(body, HttpResponse):
        return body
    name = body["model"]
    entry, catalog = routing.catalog_cache.lookup(name)
    if entry is None:
        names = [e.name for e in catalog.usable()]
        _count(name="unknown", answered_by="", endpoint=endpoint, status=404)
        return errors.unknown_model(
            name, routing.entry_names_closest_first(name, names), len(names)
        )
    stream = streams and body.get("stream") is True
    board = metrics()
    board.in_flight.labels(entry.name).inc()
    handed_over = False
    try:
        response = _route_and_send(
            entry, catalog, body, request.body, path, endpoint, stream, started
        )
        handed_over = isinstance(response, StreamingHttpResponse)
        return response
    finally:
        if not handed_over:
            board.in_flight.labels(entry.name).dec()
            board.latency.labels(entry.name, endpoint).observe(time.monotonic() - started)


def _route_and_send(
    entry: routing.Entry,
    catalog: routing.Catalog,
    body: dict[str, Any],
    raw: bytes,
    path: str,
    endpoint: str,
    stream: bool,
    started: float,
) -> HttpResponseBase:
    wanted = (entry.model, *entry.fallbacks)
    deadline = started + conf.wait_seconds()
    replicas = routing.read_replicas(wanted)
    services.model_asked_for(entry, nothing_ready=not _any_ready(entry, replicas))
    while True:
        decision = routing.decide(entry, replicas, catalog, may_wait=time.monotonic() < deadline)
        if not isinstance(decision, routing.Wait):
            break
        services.model_asked_for(entry, nothing_ready=True)
        time.sleep(min(WAIT_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        replicas = routing.read_replicas(wanted)

    if isinstance(decision, routing.Unavailable):
        _count(entry.name, "", endpoint, 503)
        return errors.unavailable(decision.message, decision.retry_after)
    assert isinstance(decision, routing.Serve)
    if decision.fallback_from is not None:
        metrics().fallbacks.labels(entry.name, decision.model).inc()

    # The body goes on as it came, unless a fallback answers (the engine must be asked for
    # the name it serves).
    if decision.engine_name == body["model"]:
        payload = raw
    else:
        payload = json.dumps({**body, "model": decision.engine_name}).encode()
    target = catalog.entries[decision.model]

    def refresh() -> tuple[routing.Candidate, ...]:
        fresh = routing.read_replicas([target.model]).get(target.model, [])
        return tuple(c for c in fresh if c.ready and c.serves(target))

    try:
        answer = proxy.send(
            decision, path, payload, stream=stream, balancer=routing.balancer, refresh=refresh
        )
    except proxy.ReplicaTimeout as exc:
        log.warning("gateway: %s for %s", exc, entry.name)
        _count(entry.name, decision.model, endpoint, 504)
        return errors.openai_error(
            504,
            f"The replica of {decision.model} did not answer within {exc.seconds:.0f}s.",
            code="replica_timeout",
            kind="server_error",
        )
    except proxy.ReplicaGone as exc:
        log.warning("gateway: %s for %s", exc, entry.name)
        _count(entry.name, decision.model, endpoint, 502)
        return errors.unreachable(decision.model)
    if answer.retried:
        metrics().retries.labels(entry.name).inc()

    if not answer.streaming:
        routing.balancer.release(answer.candidate)
        assert answer.body is not None
        if answer.status == 200:
            prompt, completion = proxy.usage_of(answer.body)
            _tokens(decision.model, prompt, completion)
        _count(entry.name, decision.model, endpoint, answer.status)
        response = HttpResponse(answer.body, status=answer.status, content_type=answer.content_type)
        response[MODEL_HEADER] = decision.model
        return response

    streaming = StreamingHttpResponse(
        _PassOn(answer, entry, decision.model, endpoint, started),
        content_type=answer.content_type,
    )
    streaming[MODEL_HEADER] = decision.model
    streaming["Cache-Control"] = "no-cache"
    streaming["X-Accel-Buffering"] = "no"  # a proxy in front must not hold chunks back either
    return streaming


def _any_ready(entry: routing.Entry, replicas: dict[str, list[routing.Candidate]]) -> bool:
    return any(c.ready and c.serves(entry) for c in replicas.get(entry.model, []))


class _PassOn:
    """The stream, chunk by chunk as the replica sends it.

    The books (in-flight counts, metrics, the replica's connection) are closed in
    close(), which the server calls when the response ends, also when the client
    hangs up and also when the stream was never started.
    """

    def __init__(
        self,
        answer: proxy.Answer,
        entry: routing.Entry,
        answered_by: str,
        endpoint: str,
        started: float,
    ) -> None:
        self.answer = answer
        self.entry = entry
        self.answered_by = answered_by
        self.endpoint = endpoint
        self.started = started
        self.tally = proxy.StreamTally()
        self.failed = False
        self.closed = False
        self._chunks = self._relay()

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks

    def _relay(self) -> Generator[bytes, None, None]:
        self.tally.feed(self.answer.first)
        yield self.answer.first
        try:
            for chunk in self.answer.rest:
                self.tally.feed(chunk)
                yield chunk
        except proxy.STREAM_ERRORS as exc:
            # Too late to retry or to change the status: say so in the stream, in the shape
            # OpenAI clients raise as an error, rather than end it as though it were complete.
            self.failed = True
            log.warning("gateway: the replica of %s broke off a stream: %s", self.answered_by, exc)
            error = {
                "message": f"The replica of {self.answered_by} broke off the answer; try again.",
                "type": "server_error",
                "code": "stream_broken",
            }
            yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._chunks.close()
        self.answer.close()
        routing.balancer.release(self.answer.candidate)
        board = metrics()
        board.in_flight.labels(self.entry.name).dec()
        board.latency.labels(self.entry.name, self.endpoint).observe(
            time.monotonic() - self.started
        )
        _tokens(self.answered_by, *self.tally.totals())
        _count(self.entry.name, self.answered_by, self.endpoint, 502 if self.failed else 200)


def _count(name: str, answered_by: str, endpoint: str, status: int) -> None:
    metrics().requests.labels(name, answered_by, endpoint, str(status)).inc()


def _tokens(model: str, prompt: int, completion: int) -> None:
    board = metrics()
    if prompt:
        board.tokens.labels(model, "prompt").inc(prompt)
    if completion:
        board.tokens.labels(model, "completion").inc(completion)


# -- /metrics ----------------------------------------------------------------------------


@require_GET
def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus's text format; open like most exporters (it holds model names and counts)."""
    from .metrics import exposition

    text, content_type = exposition()
    return HttpResponse(text, content_type=content_type)
