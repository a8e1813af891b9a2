"""Traces over OTLP/HTTP, with OpenTelemetry's SDK and its maintained instrumentations.

On only when OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; off,
nothing of OpenTelemetry is imported, so it costs nothing. The SDK reads the other OTEL_*
variables itself. Each process calls start_tracing once, where it starts; the node agent too,
so this module is below Django.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from importlib import import_module
from typing import Any

# What each name in start_tracing's `instrument` turns on (module, class). The gateway makes its
# own spans (gateway.tracing) rather than aiohttp's instrumentation: its engine call is one span
# from the request to the answer's last byte, with the replica and why it was chosen, and costs
# one flag test when tracing is off.
INSTRUMENTATIONS = {
    "django": ("opentelemetry.instrumentation.django", "DjangoInstrumentor"),
    "celery": ("opentelemetry.instrumentation.celery", "CeleryInstrumentor"),
    "requests": ("opentelemetry.instrumentation.requests", "RequestsInstrumentor"),
    "psycopg": ("opentelemetry.instrumentation.psycopg", "PsycopgInstrumentor"),
    "redis": ("opentelemetry.instrumentation.redis", "RedisInstrumentor"),
}

_started: str | None = None


def tracing_wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces: an OTLP endpoint, and the SDK not turned off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    )


def _names_service(environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SERVICE_NAME", "").strip():
        return True
    pairs = environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(p.split("=", 1)[0].strip() == "service.name" for p in pairs)


def start_tracing(
    process_name: str,
    instrument: Iterable[str] = ("requests",),
    *,
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Export this process's spans when the environment asks for it (tracing_wanted), as the
    service `process_name` unless OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES)
    names one, with the instrumentations named in `instrument` (INSTRUMENTATIONS) turned on.

    Once per process: a later call does nothing. True when tracing is on. `environ` decides
    whether; what the SDK reads for the rest is os.environ."""
    global _started
    if _started is not None:
        return True
    if not tracing_wanted(environ):
        return False
    # OpenTelemetry is imported only once tracing is on: off, it costs nothing.
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The resource, the sampler, the exporter's endpoint, headers and timeout, and the batch
    # sizes all come from the standard OTEL_* variables, read by the SDK itself.
    attributes = {} if _names_service(environ) else {SERVICE_NAME: process_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    for name in instrument:
        module, cls = INSTRUMENTATIONS[name]
        instrumentor = getattr(import_module(module), cls)()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=provider)
    _started = process_name
    return True


# -- work that outlives a request: a trace kept as a traceparent -----------------------------


def begin(name: str, attributes: Mapping[str, Any]) -> str:
    """Start a trace for work that outlives this process's part of it (a rollout across tasks and
    workers): a span `name` under the current one (the request that asked for the work), ended
    at once, whose W3C traceparent is returned to be stored with the work; "" with tracing off."""
    if _started is None:
        return ""
    from opentelemetry import propagate, trace  # only with tracing on, as in start_tracing

    with trace.get_tracer("llmgw").start_as_current_span(name, attributes=dict(attributes)):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
    return carrier.get("traceparent", "")


def enabled() -> bool:
    """Whether this process exports traces (start_tracing turned them on)."""
    return _started is not None


@contextlib.contextmanager
def continued(
    traceparent: str, name: str, attributes: Mapping[str, Any], *, link_current: bool = False
) -> Iterator[Any]:
    """A span `name` in the trace `traceparent` names (begin's), current while the block runs;
    nothing with tracing off or no traceparent (the block gets None). `link_current`: the span
    links to the one current here (the request it happens in, a trace of its own)."""
    if _started is None or not traceparent:
        yield None
        return
    from opentelemetry import propagate, trace  # only with tracing on, as in start_tracing

    links = []
    if link_current:
        here = trace.get_current_span().get_span_context()
        if here.is_valid:
            links.append(trace.Link(here))
    parent = propagate.extract({"traceparent": traceparent})
    tracer = trace.get_tracer("llmgw")
    with tracer.start_as_current_span(
        name, context=parent, attributes=dict(attributes), links=links
    ) as span:
        yield span


def trace_id_of(traceparent: str) -> str:
    """The trace id (32 hex digits) of a W3C traceparent, "" for none."""
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


def mark_failed(span: Any, message: str) -> None:
    """Set a span's status to an error saying `message` (a span of `continued`'s)."""
    from opentelemetry.trace import Status, StatusCode  # a span exists: tracing is on

    span.set_status(Status(StatusCode.ERROR, message))
