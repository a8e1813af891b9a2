"""The node agent (llmgw/node.py) end to end: the real agent as a subprocess, the real llama.cpp
engine, tiny generated models served over HTTP, and a fake control plane whose answers the tests
set and whose recorded heartbeats they read.

Every process started here (agents, and the engines they start) is stopped by its pid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from llmgw import engine
from llmgw.tinygguf import write_lora_adapter, write_tiny_model
from tests.support.fake_control_plane import FakeControlPlane, fake_control_plane
from tests.support.http_files import ServerStats, serve_directory

try:
    import llama_cpp  # noqa: F401

    HAVE_ENGINE = True
except ImportError:
    HAVE_ENGINE = False

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not HAVE_ENGINE,
        reason="llama-cpp-python is not installed (pip install -e '.[engine]'); "
        "these tests run the real engine",
    ),
]

REPO = Path(__file__).resolve().parent.parent
TOKEN = "node-token-1"
MODEL = "tiny-chat"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Mirror:
    url: str
    stats: ServerStats
    files: Path

    def source(self, name: str) -> str:
        return f"{self.url}/{name}"

    def sha(self, name: str) -> str:
        return sha256_of(self.files / name)

    def gets(self, name: str) -> int:
        return sum(1 for r in self.stats.requests if r.method == "GET" and r.path == f"/{name}")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mirror")
    write_tiny_model(folder / "model.gguf", seed=1)
    write_lora_adapter(folder / "sql.gguf", seed=2)
    write_lora_adapter(folder / "qwen-lora.gguf", architecture="qwen2", seed=3)
    (folder / "not-a-model.gguf").write_bytes(b"this is not a GGUF file\n" * 100)
    return folder


@pytest.fixture
def mirror(files: Path) -> Iterator[Mirror]:
    with serve_directory(files) as (url, stats):
        yield Mirror(url, stats, files)


@pytest.fixture
def plane() -> Iterator[FakeControlPlane]:
    with fake_control_plane(TOKEN, heartbeat_interval=0.2) as plane:
        yield plane


def free_port_range(size: int = 20) -> str:
    """A block of ports below Linux's ephemeral range (so outgoing connections do not take
    them) whose first port is free now."""
    for _ in range(50):
        low = random.randrange(20000, 32000 - size)
        if engine.port_is_free("127.0.0.1", low):
            return f"{low}-{low + size - 1}"
    raise RuntimeError("no free port block found")


@dataclass
class AgentProcess:
    process: subprocess.Popen[bytes]
    log: Path
    cache: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class Agents:
    """Starts agents; stops them, and any engine they leave, by pid at the end of the test."""

    tmp_path: Path
    plane: FakeControlPlane
    started: list[AgentProcess] = field(default_factory=list)
    engine_pids: set[int] = field(default_factory=set)

    def start(
        self,
        *extra: str,
        cache: Path | None = None,
        server: str | None = None,
        port_range: str | None = None,
        stop_engines_on_exit: bool = True,
    ) -> AgentProcess:
        cache = cache or self.tmp_path / "cache"
        log = self.tmp_path / f"agent-{len(self.started)}.log"
        command = [
            sys.executable,
            "-m",
            "llmgw",
            "node",
            "--server",
            server or self.plane.url,
            "--token",
            TOKEN,
            "--memory",
            "8",
            "--cores",
            "2",
            "--cache",
            str(cache),
            "--port-range",
            port_range or free_port_range(),
            "--heartbeat-interval",
            "0.2",
            "--ready-timeout",
            "30",
            *(["--stop-engines-on-exit"] if stop_engines_on_exit else []),
            *extra,
        ]
        with open(log, "wb") as out:
            process = subprocess.Popen(
                command,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        agent = AgentProcess(process, log, cache)
        self.started.append(agent)
        return agent

    def engine_pid(self, agent: AgentProcess, replica_id: str) -> int:
        state = json.loads((agent.cache / "replicas" / replica_id / "state.json").read_text())
        pid = state["pid"]
        assert isinstance(pid, int)
        self.engine_pids.add(pid)
        return pid

    def stop_all(self) -> None:
        for agent in self.started:
            if agent.alive():
                agent.process.send_signal(signal.SIGTERM)
                try:
                    agent.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    agent.process.kill()
                    agent.process.wait()
            # Engines that outlived their agent, found through the agent's own records.
            for state_file in (agent.cache / "replicas").glob("*/state.json"):
                with contextlib.suppress(OSError, ValueError):
                    pid = json.loads(state_file.read_text()).get("pid")
                    if isinstance(pid, int):
                        self.engine_pids.add(pid)
        for pid in self.engine_pids:
            command = engine.process_cmdline(pid)
            if command is not None and "llama_cpp.server" in command:
                engine.stop_process_group(pid, grace=5)


@pytest.fixture
def agents(tmp_path: Path, plane: FakeControlPlane) -> Iterator[Agents]:
    agents = Agents(tmp_path, plane)
    try:
        yield agents
    finally:
        agents.stop_all()


def replica_spec(mirror: Mirror, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "id": str(uuid.uuid4()),
        "model": MODEL,
        "source": mirror.source("model.gguf"),
        "sha256": mirror.sha("model.gguf"),
        "adapters": [],
        "context_length": 256,
        "threads": 1,
    }
    spec.update(overrides)
    return spec


def state_of(plane: FakeControlPlane, replica_id: str, *states: str) -> Callable[[Any], Any]:
    """A wait_for condition: the replica's report once it is in one of ``states``."""

    def condition(report: dict[str, Any]) -> dict[str, Any] | None:
        replica = plane.replica(report, replica_id)
        return replica if replica is not None and replica["state"] in states else None

    return condition


def wait_until(condition: Callable[[], Any], *, timeout: float = 15, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def complete(port: int, model: str, prompt: str = "hi") -> dict[str, Any]:
    answer = requests.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def port_accepts(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


# -- the tests ------------------------------------------------------------------------------


def test_it_fetches_starts_and_reports_a_ready_replica(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    # No sha256 in the catalog: the agent reports the one it computed.
    spec = replica_spec(mirror, sha256=None)
    plane.want([spec])
    agent = agents.start()

    ready = plane.wait_for(state_of(plane, spec["id"], "ready", "failed"), what="ready")

    assert ready["state"] == "ready", ready["message"]
    assert ready["sha256"] == mirror.sha("model.gguf")
    assert ready["message"] == f"ready on port {ready['port']}"
    assert complete(ready["port"], MODEL)["model"] == MODEL
    report = plane.last()
    assert report is not None
    assert report["capacity"] == {"memory_gb": 8.0, "cores": 2, "gpus": 0, "gpu_memory_gb": 0}
    assert report["address"] == "127.0.0.1"
    assert report["agent"]["pid"] == agent.pid
    assert plane.heartbeats[-1].authorization == f"Bearer {TOKEN}"
    blob = agent.cache / "blobs" / mirror.sha("model.gguf")
    assert blob.read_bytes() == (mirror.files / "model.gguf").read_bytes()
    assert json.loads((agent.cache / "urls.json").read_text()) == {
        spec["source"]: mirror.sha("model.gguf")
    }
    state = json.loads((agent.cache / "replicas" / spec["id"] / "state.json").read_text())
    assert state["port"] == ready["port"]
    assert state["spec"]["id"] == spec["id"]
    assert "--n_ctx" in state["command"] and "256" in state["command"]


def test_it_fails_a_replica_whose_download_has_the_wrong_sha256(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    wrong = "0" * 64
    spec = replica_spec(mirror, sha256=wrong)
    plane.want([spec])
    agent = agents.start()

    failed = plane.wait_for(state_of(plane, spec["id"], "failed", "ready"), what="failed")

    actual = mirror.sha("model.gguf")
    assert failed["state"] == "failed"
    assert failed["message"] == (
        f"the file at {spec['source']} (weights) has sha256 {actual}, but {wrong} was expected; "
        "the download was not kept. Either the file at the source changed or the catalog's "
        "sha256 is wrong."
    )
    assert list((agent.cache / "blobs").iterdir()) == []
    assert list((agent.cache / "tmp").iterdir()) == []
    assert not (agent.cache / "replicas" / spec["id"] / "engine.log").exists()


def test_it_refuses_an_adapter_for_another_architecture_before_any_engine_starts(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    adapter = {"name": "tiny-qwen", "source": mirror.source("qwen-lora.gguf"), "sha256": None}
    spec = replica_spec(mirror, adapters=[adapter])
    plane.want([spec])
    agent = agents.start()

    failed = plane.wait_for(state_of(plane, spec["id"], "failed", "ready"), what="failed")

    assert failed["state"] == "failed"
    assert failed["message"] == (
        f"the adapter tiny-qwen ({adapter['source']}) cannot be used with tiny-chat: "
        "it is a LoRA adapter for qwen2, not for llama. "
        "No engine was started: llama.cpp would crash on it."
    )
    reported = [plane.replica(h.body, spec["id"]) for h in plane.heartbeats]
    assert {r["state"] for r in reported if r is not None} <= {"fetching", "failed"}
    assert not (agent.cache / "replicas" / spec["id"] / "engine.log").exists()


def test_it_reports_an_engine_that_exits_at_start_with_its_last_output(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(
        mirror, source=mirror.source("not-a-model.gguf"), sha256=mirror.sha("not-a-model.gguf")
    )
    plane.want([spec])
    agents.start()

    failed = plane.wait_for(state_of(plane, spec["id"], "failed", "ready"), what="failed")

    assert failed["state"] == "failed"
    assert failed["message"].startswith("the engine exited with code 1; its last output:\n")
    assert "ValueError: Failed to load model from file" in failed["message"]
    assert len(failed["message"].splitlines()) <= 16


def test_it_stops_a_replica_removed_from_the_answer(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror)
    plane.want([spec])
    agent = agents.start()
    ready = plane.wait_for(state_of(plane, spec["id"], "ready", "failed"), what="ready")
    assert ready["state"] == "ready", ready["message"]
    pid = agents.engine_pid(agent, spec["id"])

    plane.want([])
    plane.wait_for(lambda r: r["replicas"] == [], since=plane.count(), what="no replicas")

    wait_until(lambda: not engine.process_alive(pid), what="the engine to exit")
    assert not port_accepts(ready["port"])
    wait_until(
        lambda: not (agent.cache / "replicas" / spec["id"]).exists(),
        what="the replica's folder to go",
    )
    assert (agent.cache / "blobs" / mirror.sha("model.gguf")).is_file()
    assert agent.alive()


def test_it_adopts_its_engine_after_a_restart_and_stops_it_when_unwanted(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror)
    plane.want([spec])
    port_range = free_port_range()
    first = agents.start(port_range=port_range)
    ready = plane.wait_for(state_of(plane, spec["id"], "ready", "failed"), what="ready")
    assert ready["state"] == "ready", ready["message"]
    pid = agents.engine_pid(first, spec["id"])

    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    assert engine.process_alive(pid)
    second = agents.start(port_range=port_range)

    def adopted(report: dict[str, Any]) -> dict[str, Any] | None:
        replica = plane.replica(report, spec["id"])
        if report["agent"]["pid"] == second.pid and replica and replica["state"] == "ready":
            return replica
        return None

    again = plane.wait_for(adopted, since=plane.count(), what="the adopted replica ready")
    assert again["port"] == ready["port"]
    assert again["sha256"] == mirror.sha("model.gguf")
    assert f"(engine pid {pid}, adopted from an earlier agent)" in again["message"]
    assert agents.engine_pid(second, spec["id"]) == pid
    assert complete(again["port"], MODEL)["model"] == MODEL

    plane.want([])
    wait_until(lambda: not engine.process_alive(pid), what="the adopted engine to stop")
    assert second.alive()


def test_it_keeps_running_through_401_garbage_and_errors(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror)
    plane.want([spec])
    agent = agents.start()
    ready = plane.wait_for(state_of(plane, spec["id"], "ready", "failed"), what="ready")
    assert ready["state"] == "ready", ready["message"]
    pid = agents.engine_pid(agent, spec["id"])

    plane.token = "another-token"  # the node was removed
    wait_until(lambda: "does not know this node's token" in agent.output(), what="the 401 line")
    since = plane.count()
    plane.wait_for(lambda r: True, since=since + 3, what="more heartbeats")
    assert agent.output().count("does not know this node's token") == 1
    plane.token = TOKEN

    for status, body in [
        (200, "this is not JSON"),
        (200, {"replicas": "all of them"}),
        (200, {"replicas": [{"id": "x"}]}),
        (500, {"detail": "the database is down"}),
    ]:
        plane.answer_with(status, body)
        plane.wait_for(lambda r: True, since=plane.count() + 2, what="two heartbeats")
    plane.answer_normally()

    output = agent.output()
    assert "answered something this agent does not understand" in output
    assert "refused the heartbeat (HTTP 500): the database is down" in output
    assert agent.alive()
    assert engine.process_alive(pid)
    still = plane.wait_for(
        state_of(plane, spec["id"], "ready", "failed"), since=plane.count(), what="ready"
    )
    assert still["state"] == "ready"
    assert agents.engine_pid(agent, spec["id"]) == pid


def test_it_keeps_trying_when_the_control_plane_is_unreachable(
    plane: FakeControlPlane, agents: Agents
) -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        closed_port = placeholder.getsockname()[1]
    agent = agents.start(server=f"http://127.0.0.1:{closed_port}")

    wait_until(lambda: "cannot reach the control plane" in agent.output(), what="the line")
    time.sleep(0.6)  # a few more attempts
    assert agent.alive()
    assert agent.output().count("cannot reach the control plane") == 1


def test_it_gives_two_replicas_of_one_model_their_own_ports_and_fetches_once(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    first, second = replica_spec(mirror), replica_spec(mirror)
    plane.want([first, second])
    agents.start()

    def both_ready(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        a, b = plane.replica(report, first["id"]), plane.replica(report, second["id"])
        if a and b and {a["state"], b["state"]} <= {"ready", "failed"}:
            return a, b
        return None

    a, b = plane.wait_for(both_ready, what="both replicas settled")

    assert (a["state"], b["state"]) == ("ready", "ready"), (a["message"], b["message"])
    assert a["port"] != b["port"]
    assert complete(a["port"], MODEL)["model"] == MODEL
    assert complete(b["port"], MODEL)["model"] == MODEL
    assert mirror.gets("model.gguf") == 1


def test_it_serves_an_adapter_under_its_own_name(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    adapter = {"name": "tiny-sql", "source": mirror.source("sql.gguf"), "sha256": None}
    spec = replica_spec(mirror, adapters=[adapter])
    plane.want([spec])
    agent = agents.start()

    ready = plane.wait_for(state_of(plane, spec["id"], "ready", "failed"), what="ready")

    assert ready["state"] == "ready", ready["message"]
    assert ready["message"] == (
        f"ready on port {ready['port']}, serving tiny-chat and its adapters tiny-sql"
    )
    port = ready["port"]
    names = [m["id"] for m in requests.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]]
    assert names == [MODEL, "tiny-sql"]
    with_adapter = complete(port, "tiny-sql")
    base = complete(port, MODEL)
    assert with_adapter["model"] == "tiny-sql"
    assert with_adapter["choices"][0]["text"] != base["choices"][0]["text"]
    config = json.loads((agent.cache / "replicas" / spec["id"] / "engine.json").read_text())
    assert [entry["model_alias"] for entry in config["models"]] == [MODEL, "tiny-sql"]
    assert config["models"][1]["lora_path"] == str(agent.cache / "blobs" / mirror.sha("sql.gguf"))


def test_it_fails_a_replica_whose_engine_dies_after_it_was_ready(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror)
    plane.want([spec])
    agent = agents.start()
    ready = plane.wait_for(state_of(plane, spec["id"], "ready", "failed"), what="ready")
    assert ready["state"] == "ready", ready["message"]

    os.kill(agents.engine_pid(agent, spec["id"]), signal.SIGKILL)

    failed = plane.wait_for(state_of(plane, spec["id"], "failed"), what="failed")
    assert failed["message"].startswith(
        "the engine was killed by signal 9 (SIGKILL); its last output:\n"
    )
    assert "POST /v1/completions" in failed["message"]  # the readiness check, in the engine log


def test_it_stops_an_engine_that_is_not_ready_in_time(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror)
    plane.want([spec])
    # The engine takes about a second to import and load; give it a tenth of that.
    agent = agents.start("--ready-timeout", "0.1")

    failed = plane.wait_for(state_of(plane, spec["id"], "failed", "ready"), what="failed")

    assert failed["state"] == "failed"
    assert failed["message"].startswith(
        "the engine did not become ready within 0.1 s; its last output:\n"
    )
    state = json.loads((agent.cache / "replicas" / spec["id"] / "state.json").read_text())
    assert state["state"] == "failed" and state["pid"] is None
    started = re.search(r"starting the engine \(pid (\d+)\)", agent.output())
    assert started is not None
    agents.engine_pids.add(int(started.group(1)))
    assert not engine.process_alive(int(started.group(1)))


def test_it_leaves_engines_running_on_sigterm_unless_told_to_stop_them(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    good = replica_spec(mirror)
    bad = replica_spec(mirror, sha256="1" * 64)
    plane.want([good, bad])
    port_range = free_port_range()
    first = agents.start(port_range=port_range, stop_engines_on_exit=False)
    ready = plane.wait_for(state_of(plane, good["id"], "ready", "failed"), what="ready")
    failed = plane.wait_for(state_of(plane, bad["id"], "failed"), what="failed")
    pid = agents.engine_pid(first, good["id"])

    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=10) == 0
    assert engine.process_alive(pid)
    assert "leaving 1 engine(s) running for the next agent to adopt" in first.output()

    downloads = mirror.gets("model.gguf")
    second = agents.start(port_range=port_range, stop_engines_on_exit=True)
    again = plane.wait_for(
        state_of(plane, good["id"], "ready"), since=plane.count(), what="adopted"
    )
    assert again["port"] == ready["port"]
    # A failed replica stays failed across restarts; it is not fetched again.
    assert plane.replica(plane.last(), bad["id"]) == failed
    assert mirror.gets("model.gguf") == downloads

    second.process.send_signal(signal.SIGTERM)
    assert second.process.wait(timeout=15) == 0
    assert not engine.process_alive(pid)
