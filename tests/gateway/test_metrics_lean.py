"""The request path's series (MetricSpec.lean) write their process's file themselves
(gateway.metrics._LeanValue): a scrape must read from it exactly what prometheus_client's own
values would have written. Run in a process of its own: prometheus_client takes multiprocess
mode from its environment once, when first imported."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.support.system import run_python

SCRIPT = """
import json, os, sys
from gateway.metrics import GATEWAY_METRICS, _LeanValue, _create
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
board = _create(sys.argv[1])
lean = sorted(spec.attribute for spec in GATEWAY_METRICS if spec.lean)
requests = board.requests.labels("m", "m", "chat", "200")
for _ in range(3):
    requests.inc()
board.tokens.labels("m", "prompt").inc(40)
flight = board.in_flight.labels("m")
flight.inc(); flight.inc(); flight.dec()
latency = board.latency.labels("m", "chat")
for seconds in (0.0, 0.004, 0.005, 0.2, 1000.0):
    latency.observe(seconds)
board.queue_seconds.labels("m", "served").observe(0.0)
try:
    requests.inc(-1)
    refused = False
except ValueError:
    refused = True
# A series made after the file grew (the mapping is made anew): still written in place.
for n in range(400):
    board.requests.labels(f"model-{n}", "", "chat", "200").inc()
requests.inc()
kinds = {
    "requests": type(requests._value).__name__,
    "latency": type(latency._buckets[0]).__name__,
    "in_flight": type(flight._value).__name__,
    "retries": type(board.retries.labels("m")._value).__name__,
}
registry = CollectorRegistry()
MultiProcessCollector(registry, path=sys.argv[1])
samples = {}
for family in registry.collect():
    for s in family.samples:
        samples[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
print(json.dumps({"lean": lean, "kinds": kinds, "refused": refused, "samples": samples}))
"""


def series(samples: dict[str, float], name: str, **labels: str) -> float:
    return samples[name + json.dumps(labels, sort_keys=True)]


def test_the_request_paths_series_are_read_as_written(tmp_path: Path) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    done = run_python(SCRIPT, str(folder), env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["lean"] == [
        "in_flight", "latency", "queue_depth", "queue_seconds", "requests", "tokens"
    ]  # fmt: skip
    assert found["kinds"] == {
        "requests": "_LeanValue",
        "latency": "_LeanValue",
        "in_flight": "_LeanValue",
        "retries": "MmapedValue",  # not on every request's path: prometheus_client's own
    }
    assert found["refused"], "a counter must refuse to go down"
    samples = found["samples"]
    request = {"model": "m", "answered_by": "m", "endpoint": "chat", "status": "200"}
    assert series(samples, "llmgw_gateway_requests_total", **request) == 4
    assert series(samples, "llmgw_gateway_requests_total", **{**request, "model": "model-399",
                  "answered_by": ""}) == 1  # fmt: skip
    assert series(samples, "llmgw_gateway_tokens_total", model="m", kind="prompt") == 40
    assert series(samples, "llmgw_gateway_requests_in_flight", model="m") == 1
    latency = {"model": "m", "endpoint": "chat"}
    name = "llmgw_gateway_request_duration_seconds"
    assert series(samples, f"{name}_bucket", **latency, le="0.005") == 3  # 0, 0.004, 0.005
    assert series(samples, f"{name}_bucket", **latency, le="0.25") == 4
    assert series(samples, f"{name}_bucket", **latency, le="300.0") == 4
    assert series(samples, f"{name}_bucket", **latency, le="+Inf") == 5
    assert series(samples, f"{name}_count", **latency) == 5
    assert abs(series(samples, f"{name}_sum", **latency) - 1000.209) < 1e-9
    queued = {"model": "m", "outcome": "served"}
    assert series(samples, "llmgw_gateway_queue_seconds_count", **queued) == 1
    assert series(samples, "llmgw_gateway_queue_seconds_sum", **queued) == 0
