"""llmgw.tracing's reading of the standard OTEL_* variables, and the test receiver's bounds."""

from __future__ import annotations

import gzip

import pytest
import requests

from llmgw.tracing import _names_service, tracing_wanted
from tests.support.otlp import MAX_BODY, OtlpReceiver
from tests.support.system import run_python

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, False),
        (ENDPOINT, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, False),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "false"}, True),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_SERVICE_NAME": "web"}, False),  # a name is not a place to send to
    ],
)
def test_tracing_is_on_only_with_an_endpoint(environ: dict[str, str], wanted: bool) -> None:
    assert tracing_wanted(environ) is wanted


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "edge-web"}, True),
        ({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod, service.name=x"}, True),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.namespace=llmgw"}, False),
    ],
)
def test_a_service_named_in_the_environment_keeps_its_name(
    environ: dict[str, str], named: bool
) -> None:
    assert _names_service(environ) is named


_START = """
import json, os, sys
from llmgw.tracing import start_tracing
from opentelemetry import trace
print(start_tracing("llmgw-node", ("requests",)), start_tracing("llmgw-web"))
trace.get_tracer("t").start_span("one").end()
trace.get_tracer_provider().force_flush()
"""


@pytest.mark.parametrize(
    ("extra", "service"),
    [({}, "llmgw-node"), ({"OTEL_SERVICE_NAME": "edge-node"}, "edge-node")],
)
def test_a_process_exports_as_its_service_once(extra: dict[str, str], service: str) -> None:
    with OtlpReceiver() as receiver:
        env = {"PATH": "/usr/bin:/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **extra}
        result = run_python(_START, env=env, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["True", "True"]  # the second call is a no-op
        assert [(s.service, s.name) for s in receiver.snapshot()] == [(service, "one")]


def test_the_receiver_refuses_a_body_past_its_cap() -> None:
    with OtlpReceiver() as receiver:
        url = f"{receiver.endpoint}/v1/traces"
        assert requests.post(url, data=b"", timeout=5).status_code == 200  # no spans
        assert requests.post(url, data=b"x" * (MAX_BODY + 1), timeout=5).status_code == 413
        bomb = gzip.compress(b"\0" * (MAX_BODY + 1))
        headers = {"Content-Encoding": "gzip"}
        assert requests.post(url, data=bomb, headers=headers, timeout=5).status_code == 413
        assert requests.post(url, data=b"\xff\xff", timeout=5).status_code == 400
        assert receiver.snapshot() == []
        assert receiver.refused == 3
