"""Traces of the gateway's requests, with OpenTelemetry, when OTEL_EXPORTER_OTLP_ENDPOINT is set.

A request to /v1/ is one trace, or a part of the client's when it sent a `traceparent`: a server
span for the request (the model asked for and the one that answered, the tokens, the status, the
request's ID), and under it `key check`, `route` (the model and candidates chosen, a fallback or
a canary's share), `queue wait` (the fair queue) and the engine call, a client span that lasts
until the answer's last byte (the replica, why it was chosen, the time to its first token, a
retry as an event) and whose `traceparent` goes to the engine with the request. Attributes
follow OpenTelemetry's GenAI conventions where they have one (gen_ai.*).

Off (the default), Tracer.on is False: the request path tests that one flag and nothing of
OpenTelemetry is imported (bench/gateway.py measures what the flag costs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from llmgw.tracing import start_tracing


def _carrier(scope: Mapping[str, Any]) -> dict[str, str]:
    """The trace headers the client sent (traceparent, tracestate), for the propagator."""
    found = {}
    for name, value in scope.get("headers") or ():
        if name in (b"traceparent", b"tracestate"):
            found[name.decode()] = value.decode("latin-1")
    return found


class Tracer:
    """A gateway's tracing: off (`on` False, nothing of OpenTelemetry imported) unless
    started where the environment asks for traces. The gateway (gateway.process) holds one
    and hands it to what traces; the request path tests `on` and nothing else while off."""

    def __init__(self) -> None:
        self.on = False
        self._tracer: Any = None
        self._propagator: Any = None

    def start(self) -> bool:
        """Turn tracing on when the environment asks for it (llmgw.tracing); whether it is."""
        if self.on or not start_tracing("llmgw-gateway", ()):
            return self.on
        from opentelemetry import propagate, trace  # only with tracing on: its cost is the import

        self._tracer = trace.get_tracer("llmgw.gateway")
        self._propagator = propagate.get_global_textmap()
        self.on = True
        return True

    @contextlib.contextmanager
    def request(self, scope: Mapping[str, Any], operation: str, request_id: str) -> Iterator[Any]:
        """The request's server span, current while the block runs (call only when on); `operation`
        is its endpoint's in GenAI's words (gen_ai.operation.name, gateway.endpoints)."""
        from opentelemetry.trace import SpanKind  # imported only with tracing on

        parent = self._propagator.extract(_carrier(scope))
        path = scope.get("path", "")
        with self._tracer.start_as_current_span(
            f"{scope.get('method', 'POST')} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": scope.get("method", ""),
                "url.path": path,
                "http.route": path,
                "gen_ai.operation.name": operation,
                "llmgw.request_id": request_id,
            },
        ) as span:
            yield span

    @contextlib.contextmanager
    def step(self, name: str, **attributes: Any) -> Iterator[Any]:
        """A child span of the current one (call only when on)."""
        with self._tracer.start_as_current_span(name, attributes=_plain(attributes)) as span:
            yield span

    def engine_call(self, model: str, operation: str, system: str) -> Any:
        """The engine call's client span, current until `end_engine_call` (call only when on): it
        outlives the function that starts it, for a stream ends when its last chunk is relayed."""
        from opentelemetry import context, trace  # imported only with tracing on
        from opentelemetry.trace import SpanKind  # imported only with tracing on

        # The request's span learns the engine here, once its replicas are known.
        trace.get_current_span().set_attribute("gen_ai.system", system)
        span = self._tracer.start_span(
            f"engine {model}",
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.system": system,
                "gen_ai.request.model": model,
            },
        )
        token = context.attach(trace.set_span_in_context(span))
        return span, token

    def end_engine_call(self, started: Any, error: str | None = None, **attributes: Any) -> None:
        from opentelemetry import context  # imported only with tracing on
        from opentelemetry.trace import Status, StatusCode  # imported only with tracing on

        span, token = started
        span.set_attributes(_plain(attributes))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
        with contextlib.suppress(ValueError):  # detached in another context (a task's copy)
            context.detach(token)

    def outcome(
        self, span: Any, status: int, name: str | None, answered_by: str, usage: dict[str, int]
    ) -> None:
        """What the request ended with, on its server span."""
        from opentelemetry.trace import Status, StatusCode  # imported only with tracing on

        span.set_attributes({"http.response.status_code": status, **usage})
        if name is not None:
            span.set_attribute("gen_ai.request.model", name)
        if answered_by:
            span.set_attribute("gen_ai.response.model", answered_by)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))

    def engine_headers(self) -> dict[str, str]:
        """The current span's traceparent (and tracestate) for the engine's request; {} when off."""
        if not self.on:
            return {}
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        return carrier

    def current_event(self, name: str, **attributes: Any) -> None:
        """An event on the current span (call only when on)."""
        from opentelemetry import trace  # imported only with tracing on

        trace.get_current_span().add_event(name, _plain(attributes))


def _plain(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attributes OpenTelemetry takes: no None values."""
    return {k: v for k, v in attributes.items() if v is not None}
