"""A rollout is one trace: the update asked for through the API begins it under the request, and
its fetch, swap, each replacement step and its end are spans of it in the worker's processes, and
the nodes' heartbeats that change its replicas' states are spans of it in the web; the audit
entries name it. Real processes: olah, the control plane, an agent running llama.cpp."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support.otlp import OtlpReceiver, Span
from tests.support.registry import LocalRegistry, available
from tests.support.system import System, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(find_engine() is None, reason="llama-server is not built (make setup)"),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

REPO = "acme/traced-GGUF"
FILE = "traced-q4.gguf"
MODEL = "traced-q4"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("rollout-traces")
    for seed in (1, 2):
        write_tiny_model(folder / f"w{seed}.gguf", seed=seed)
    registry = LocalRegistry(folder / "registry")
    registry.commit(REPO, {FILE: folder / "w1.gguf"})
    registry.start()
    with OtlpReceiver() as receiver:
        system = System(folder / "system", config={"registry": {"endpoint": registry.endpoint}})
        system.env.update(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        )
        try:
            with system.running():
                system.add_ready_nodes(memory_gb=2, cores=2, names=("node-a",))
                yield {
                    "system": system,
                    "registry": registry,
                    "folder": folder,
                    "receiver": receiver,
                }
        finally:
            registry.stop()


def _routable(system: System) -> bool:
    """The served model is there (after its fetch) with its one replica ready."""
    if MODEL not in {m["name"] for m in system.api("GET", "models")}:
        return False
    replicas = system.api("GET", f"models/{MODEL}/target")["replicas"]
    live = [r for r in replicas if r["state"] != "withdrawn"]
    return len(live) == 1 and live[0]["routable"]


def test_an_update_is_one_trace_linked_from_its_audit_entries(world: dict[str, Any]) -> None:
    system, registry, receiver = world["system"], world["registry"], world["receiver"]
    system.api(
        "POST", "serve", json={"repo": REPO, "name": MODEL, "min": 1, "memory_gb": 1, "cores": 1}
    )
    wait_for(lambda: _routable(system), timeout=120, what="the served model ready")
    registry.commit(REPO, {FILE: world["folder"] / "w2.gguf"}, message="retrained")
    system.api("POST", "updates/check")
    system.api("POST", f"models/{MODEL}/update")

    def done() -> dict[str, Any] | None:
        entries = system.api("GET", "audit", params={"model": MODEL})["entries"]
        return next((e for e in entries if e["action"] == "update-done"), None)

    wait_for(done, timeout=120, what="the update done")
    entries = system.api("GET", "audit", params={"model": MODEL})["entries"]
    by_action = {e["action"]: e for e in entries}
    trace_id = by_action["update"]["trace_id"]
    assert len(trace_id) == 32
    for action in ("update-swap", "update-done"):
        assert by_action[action]["trace_id"] == trace_id, action
    assert by_action["add"]["trace_id"] == ""  # not part of a rollout

    def spans() -> dict[str, Span] | None:
        found = {s.name: s for s in receiver.trace(trace_id)}
        wanted = {f"rollout {MODEL}: update", "fetch", "swap", "replica ready", "update-done"}
        return found if wanted <= set(found) else None

    found = wait_for(spans, timeout=30, what="the rollout's spans")
    for span in sorted(found.values(), key=lambda s: s.start_ns):
        print(span)
    begun = found[f"rollout {MODEL}: update"]
    # Begun by the web, under the API request that asked for the update.
    assert begun.service == "llmgw-web"
    request = wait_for(
        lambda: next((s for s in receiver.trace(trace_id) if s.span_id == begun.parent_id), None),
        timeout=30,
        what="the API request's span",
    )
    assert request.name == "POST api/v1/models/<str:name>/update"
    # The steps, in the worker's processes, each a child of the rollout's span.
    for name in ("fetch", "swap", "update-done"):
        assert (found[name].service, found[name].parent_id) == ("llmgw-worker", begun.span_id)
    assert found["fetch"].attributes["llmgw.fetch.state"] == "done"
    assert found["fetch"].attributes["llmgw.fetch.bytes"] > 0
    # A step the rollout showed between two of its passes ("replaced 0 of 1; a new replica is
    # starting"): none when the new replica was ready by the next pass, as it may be here.
    steps = [s for s in receiver.trace(trace_id) if s.name.startswith("replaced ")]
    assert all((s.service, s.parent_id) == ("llmgw-worker", begun.span_id) for s in steps)
    assert found["update-done"].attributes["llmgw.message"].startswith("every replica runs")
    assert found["fetch"].start_ns < found["swap"].start_ns < found["update-done"].start_ns
    # The node's heartbeat that said the new replica was ready: a span of the rollout (made by
    # the web, which took the heartbeat), linked to the heartbeat's own trace.
    ready = found["replica ready"]
    assert (ready.service, ready.parent_id) == ("llmgw-web", begun.span_id)
    assert ready.attributes["llmgw.node"] == "node-a"
    ((linked_trace, linked_span),) = ready.links
    heartbeat = wait_for(
        lambda: next((s for s in receiver.trace(linked_trace) if s.span_id == linked_span), None),
        timeout=30,
        what="the heartbeat's own span",
    )
    assert heartbeat.name == "POST api/v1/node/heartbeat"
