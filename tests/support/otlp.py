"""An OTLP/HTTP receiver for tests: what llmgw's processes export when OTEL_EXPORTER_OTLP_ENDPOINT
names it.

It listens on 127.0.0.1 (a free port), takes POST /v1/traces with a protobuf body (an
ExportTraceServiceRequest, gzip allowed) of at most MAX_BODY bytes, and keeps each span's trace
id, span id, parent id, name, kind, service name and attributes, up to MAX_SPANS spans. The test
stops it (close, or `with`).
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

MAX_BODY = 4 * 1024 * 1024
MAX_SPANS = 100_000


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    kind: int
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    # (name, attributes) of each event, in order; the status code (0 unset, 1 ok, 2 error).
    events: tuple[tuple[str, dict[str, Any]], ...] = ()
    status: int = 0
    start_ns: int = 0
    end_ns: int = 0
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) of each linked span

    def __str__(self) -> str:
        attrs = " ".join(f"{k}={v!r}" for k, v in sorted(self.attributes.items()))
        parent = self.parent_id or "-"
        return f"{self.service:<13} {self.name!r} trace={self.trace_id} span={self.span_id} parent={parent} {attrs}"


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which) if which else None


def decode(body: bytes) -> list[Span]:
    """The spans of one ExportTraceServiceRequest."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    Span(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        service=service,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=tuple(
                            (e.name, {a.key: _value(a.value) for a in e.attributes})
                            for e in span.events
                        ),
                        status=span.status.code,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        links=tuple((k.trace_id.hex(), k.span_id.hex()) for k in span.links),
                    )
                )
    return spans


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.refused = 0  # requests answered with an error
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                status = receiver._take(self)
                self.send_response(status)
                body = ExportTraceServiceResponse().SerializeToString() if status == 200 else b""
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _take(self, handler: BaseHTTPRequestHandler) -> int:
        if handler.path != "/v1/traces":
            return 404
        try:
            length = int(handler.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.refused += 1
            return 413
        body = handler.rfile.read(length)
        try:
            if handler.headers.get("Content-Encoding", "").lower() == "gzip":
                inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
                body = inflater.decompress(body, MAX_BODY)
                if inflater.unconsumed_tail:
                    self.refused += 1
                    return 413
            spans = decode(body)
        except (zlib.error, DecodeError):
            self.refused += 1
            return 400
        with self._lock:
            self.spans.extend(spans[: MAX_SPANS - len(self.spans)])
        return 200

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
