"""Traces (llmgw.tracing): a whole llmgw as processes exporting to an OTLP receiver, and nothing
of OpenTelemetry's SDK loaded when no endpoint is set."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.otlp import OtlpReceiver, Span
from tests.support.system import System, run_python, wait_for

SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5  # OTLP's span kinds


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[System]:
    running = System(tmp_path_factory.mktemp("system"))
    running.env.update(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200",  # ms: spans arrive within the test's patience
        }
    )
    with running.running():
        yield running


def _server_span(receiver: OtlpReceiver, method: str, path: str) -> Span:
    def found() -> Span | None:
        return next(
            (
                s
                for s in receiver.snapshot()
                if s.service == "llmgw-web"
                and s.kind == SERVER
                and s.attributes.get("http.method") == method
                and path in str(s.attributes.get("http.target", ""))
            ),
            None,
        )

    return wait_for(found, timeout=30, what=f"the web's span for {method} {path}")


def test_an_api_call_through_the_gateway_arrives_as_the_webs_django_span(
    system: System, receiver: OtlpReceiver
) -> None:
    marker = uuid.uuid4().hex[:8]
    system.api("GET", f"models?trace={marker}")
    span = _server_span(receiver, "GET", f"/api/v1/models?trace={marker}")
    print(span)
    assert span.attributes["http.status_code"] == 200
    assert span.attributes["http.route"] == "api/v1/models"
    assert span.name == "GET api/v1/models"


def test_a_task_queued_by_an_api_change_runs_in_the_trace_of_the_request(
    system: System, receiver: OtlpReceiver
) -> None:
    name = f"node-{uuid.uuid4().hex[:6]}"
    system.api("POST", "nodes", json={"name": name})
    system.api("POST", f"nodes/{name}/cordon")  # fleet_changed: a reconcile pass is queued
    request = _server_span(receiver, "POST", f"/api/v1/nodes/{name}/cordon")

    def task_run() -> Span | None:
        return next(
            (
                s
                for s in receiver.trace(request.trace_id)
                if s.service == "llmgw-worker" and s.kind == CONSUMER
            ),
            None,
        )

    run = wait_for(task_run, timeout=30, what="the reconcile task's span in the request's trace")
    spans = {s.span_id: s for s in receiver.trace(request.trace_id)}
    sent = spans[run.parent_id]  # the web's publish span, under the request's
    for span in (request, sent, run):
        print(span)
    assert run.name == "run/fleet.tasks.reconcile"
    assert (sent.service, sent.kind, sent.name) == (
        "llmgw-web",
        PRODUCER,
        "apply_async/fleet.tasks.reconcile",
    )
    chain = [sent.parent_id]
    while spans.get(chain[-1]) and spans[chain[-1]].parent_id:
        chain.append(spans[chain[-1]].parent_id)
    assert request.span_id in chain


def test_beat_and_the_worker_name_themselves(system: System, receiver: OtlpReceiver) -> None:
    # Beat sends its periodic tasks (reconcile_interval: 1s) in traces of its own.
    wait_for(
        lambda: any(s.service == "llmgw-beat" for s in receiver.snapshot()),
        timeout=30,
        what="a span from beat",
    )
    services = {s.service for s in receiver.snapshot()}
    assert {"llmgw-web", "llmgw-worker", "llmgw-beat"} <= services


def test_a_node_agents_call_carries_its_trace_through_the_gateway_to_the_web(
    system: System, receiver: OtlpReceiver
) -> None:
    system.add_node(f"node-{uuid.uuid4().hex[:6]}", memory_gb=1, cores=1)

    def web_under_node() -> tuple[Span, Span] | None:
        spans = receiver.snapshot()
        calls = {s.span_id: s for s in spans if s.service == "llmgw-node" and s.kind == CLIENT}
        return next(
            (
                (calls[s.parent_id], s)
                for s in spans
                if s.service == "llmgw-web" and s.kind == SERVER and s.parent_id in calls
            ),
            None,
        )

    call, served = wait_for(web_under_node, timeout=60, what="a node's call and the web's span")
    print(call, served, sep="\n")
    assert call.trace_id == served.trace_id
    assert call.attributes["http.method"] == served.attributes["http.method"]


# How each process starts tracing, in one interpreter: the web as gunicorn loads it, then a
# worker's pool process and beat as Celery signals them, then the node agent's call.
_STARTS = """
import json, sys, types
startup = types.ModuleType("llmgw_site.startup")  # server.yaml is not this test's: no database
startup.apply_config_on_start = lambda *args, **kwargs: None
sys.modules["llmgw_site.startup"] = startup
import llmgw_site.wsgi
from celery.signals import beat_init, worker_process_init
from llmgw_site.celery import app
worker_process_init.send(sender=None)
beat_init.send(sender=app)
from llmgw.tracing import start_tracing
start_tracing("llmgw-node", ("requests",))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("opentelemetry"))))
"""


def _modules_loaded(tmp_path: Path, **otel: str) -> list[str]:
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DJANGO", "LLMGW", "PYTEST", "OTEL_"))
        },
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        "LLMGW_SECRET_KEY": "test-secret-key-for-tracing-tests",
        **otel,
    }
    result = run_python(_STARTS, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_without_an_endpoint_no_process_loads_the_sdk(tmp_path: Path) -> None:
    loaded = _modules_loaded(tmp_path)
    # Nothing of the SDK's traces, its exporter or an instrumentation. (redis-py 8 imports the
    # SDK's metrics itself, opentelemetry.sdk.metrics, whenever the SDK is installed.)
    ours = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.instrumentation")
    assert [m for m in loaded if m.startswith(ours)] == []


def test_with_an_endpoint_the_same_starts_load_it(tmp_path: Path, receiver: OtlpReceiver) -> None:
    # The check above would notice: the same script with an endpoint loads the SDK.
    loaded = _modules_loaded(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    assert "opentelemetry.sdk.trace" in loaded
    assert "opentelemetry.instrumentation.django" in loaded
