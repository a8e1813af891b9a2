"""A chat completion's trace, from the client through the gateway to a real llama-server: the
gateway's processes export to an OTLP receiver, and the spans come back with their parents and
attributes; the client's traceparent is continued and a new one goes on to the engine."""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support.http_files import serve_directory
from tests.support.otlp import OtlpReceiver, Span
from tests.support.system import System, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(find_engine() is None, reason="llama-server is not built (make setup)"),
    pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs openai"),
]

SERVER, CLIENT = 2, 3  # OTLP's span kinds
PROFILE = [{"name": "cpu", "memory_gb": 1, "cores": 1}]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("traces")
    write_tiny_model(folder / "tiny.gguf", seed=1)
    with OtlpReceiver() as receiver, serve_directory(folder) as (weights, _):
        system = System(folder / "system", allowed_hosts=[urlsplit(weights).netloc])
        system.env.update(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        )
        try:
            system.start()
            system.add_ready_nodes(memory_gb=2, cores=2, names=("node-a",))
            system.api(
                "POST",
                "models",
                json={
                    "name": "chat",
                    "source": f"{weights}/tiny.gguf",
                    "profiles": PROFILE,
                    "context_length": 256,
                    "min_replicas": 1,
                },
            )
            wait_for(
                lambda: [
                    r for r in system.api("GET", "models/chat/target")["replicas"] if r["routable"]
                ],
                timeout=120,
                what="a ready replica of chat",
            )
            key = system.api("POST", "keys", json={"name": "traces"})["key"]
            yield {"system": system, "receiver": receiver, "key": key}
        except BaseException:
            print(system.log_tail())
            raise
        finally:
            system.close()


def _trace(receiver: OtlpReceiver, trace_id: str, wanted: set[str]) -> dict[str, Span]:
    """The gateway's spans of one trace by name, once every wanted name has arrived."""

    def found() -> dict[str, Span] | None:
        spans = {s.name: s for s in receiver.trace(trace_id) if s.service == "llmgw-gateway"}
        return spans if wanted <= set(spans) else None

    return wait_for(found, timeout=30, what=f"spans {sorted(wanted)} of trace {trace_id}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chat_completion_is_one_trace_from_the_client_to_the_engine(
    world: dict[str, Any], stream: bool
) -> None:
    import openai

    system, receiver = world["system"], world["receiver"]
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    client = openai.OpenAI(base_url=f"{system.url}/v1", api_key=world["key"], max_retries=0)
    request_id = f"trace-{uuid.uuid4().hex[:8]}"
    headers = {"traceparent": f"00-{trace_id}-{parent}-01", "X-Request-ID": request_id}
    messages = [{"role": "user", "content": "hello"}]
    if stream:
        chunks = client.chat.completions.create(
            model="chat", messages=messages, max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_headers=headers,
        )  # fmt: skip
        assert list(chunks)
    else:
        answer = client.chat.completions.create(
            model="chat", messages=messages, max_tokens=5, extra_headers=headers
        )
        assert answer.usage is not None and answer.usage.completion_tokens > 0

    request_name = "POST /v1/chat/completions"
    spans = _trace(
        receiver, trace_id, {request_name, "key check", "route", "queue wait", "engine chat"}
    )
    for span in spans.values():
        print(span, span.events)
    request = spans[request_name]
    # The client's trace, continued: the request's span is a child of the client's.
    assert (request.parent_id, request.kind) == (parent, SERVER)
    assert request.attributes["llmgw.request_id"] == request_id
    assert request.attributes["gen_ai.operation.name"] == "chat"
    assert request.attributes["gen_ai.request.model"] == "chat"
    assert request.attributes["gen_ai.response.model"] == "chat"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gen_ai.usage.output_tokens"] > 0
    for name in ("key check", "route", "queue wait"):
        assert spans[name].parent_id == request.span_id, name
    assert spans["key check"].attributes["llmgw.key.refused"] is False
    assert spans["route"].attributes["llmgw.route.model"] == "chat"
    assert spans["route"].attributes["llmgw.route.candidates"] == 1
    engine = spans["engine chat"]
    assert (engine.parent_id, engine.kind) == (request.span_id, CLIENT)
    replica = system.api("GET", "models/chat/target")["replicas"][0]
    assert engine.attributes["llmgw.replica"] == replica["id"]
    assert engine.attributes["server.port"] == replica["port"]
    assert engine.attributes["llmgw.route.reason"] == "the only one"
    assert engine.attributes["gen_ai.usage.output_tokens"] > 0
    assert 0 < engine.attributes["llmgw.time_to_first_token_seconds"] < 30
    assert engine.attributes["llmgw.retried"] is False
    assert [name for name, _ in engine.events] == ["replica chosen"]
    # The engine call lasts until the answer's last byte, inside the request's span.
    assert request.start_ns <= engine.start_ns <= engine.end_ns <= request.end_ns


def test_a_refused_request_is_traced_with_its_status(world: dict[str, Any]) -> None:
    system, receiver = world["system"], world["receiver"]
    trace_id = uuid.uuid4().hex
    answer = requests.post(
        f"{system.url}/v1/chat/completions",
        json={"model": "chat", "messages": []},
        headers={
            "Authorization": "Bearer sk-llmgw-not-a-key",
            "traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01",
        },
        timeout=30,
    )
    assert answer.status_code == 401
    spans = _trace(receiver, trace_id, {"POST /v1/chat/completions", "key check"})
    assert spans["key check"].attributes["llmgw.key.refused"] is True
    assert spans["POST /v1/chat/completions"].attributes["http.response.status_code"] == 401
    assert "engine chat" not in spans


def test_no_trace_is_made_without_an_endpoint(tmp_path: Any) -> None:
    """The gateway's own switch: off unless the environment names an OTLP endpoint."""
    from gateway.asgi import application

    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    tracer = application.gateway.tracer
    assert not tracer.on
    assert tracer.engine_headers() == {}
    from llmgw.tracing import tracing_wanted

    assert not tracing_wanted(environment)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Tracing on in this process for one test, into memory (no provider set for the process):
    the gateway's tracer (gateway.tracing.Tracer) switched on with them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from gateway.asgi import application

    tracing = application.gateway.tracer
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_propagator", TraceContextTextMapPropagator())
    monkeypatch.setattr(tracing, "on", True)
    yield exporter
    provider.shutdown()


def test_the_engine_is_sent_the_engine_calls_traceparent_and_a_retry_is_an_event(
    gw: Any, catalog: Any, engine: Any, spans: Any
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    trace_id = uuid.uuid4().hex
    answer = gw.request(
        "POST",
        "/v1/completions",
        json={"model": "chat", "prompt": "a"},
        headers={"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"},
    )
    assert answer.status_code == 200
    finished = {s.name: s for s in spans.get_finished_spans()}
    call = finished["engine chat"]
    # The engine got the engine call's own span as its parent, in the client's trace.
    assert engine.traceparents == [f"00-{trace_id}-{call.context.span_id:016x}-01"]
    assert call.parent.span_id == finished["POST /v1/completions"].context.span_id

    # One replica's port refuses connections (its engine gone): the other answers, and the
    # engine call says so, with a retry event between its two choices.
    from tests.support.system import free_port

    for attempt in range(20):  # a new model each time, until the first choice refuses
        name = f"other-{attempt}"
        catalog.add(name)
        catalog.replica(name, free_port())
        catalog.replica(name, engine)
        spans.clear()
        assert gw.post("/v1/completions", {"model": name, "prompt": "a"}).status_code == 200
        call = next(s for s in spans.get_finished_spans() if s.name == f"engine {name}")
        if call.attributes["llmgw.retried"]:
            break
    assert call.attributes["llmgw.retried"] is True
    assert [e.name for e in call.events] == ["replica chosen", "retry", "replica chosen"]
    assert call.attributes["llmgw.replica"] == call.events[2].attributes["llmgw.replica"]
    assert call.attributes["server.port"] == engine.port
