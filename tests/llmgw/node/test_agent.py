"""The node agent (llmgw/node/) end to end: the real agent as a subprocess, the real llama.cpp
engine, tiny generated models served over HTTP, and a fake control plane whose answers the tests
set and whose recorded heartbeats they read.

Every process started here (agents, and the engines they start) is stopped by its pid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import requests

from llmgw import engine
from llmgw.node.config import REMOVED_EXIT_STATUS
from llmgw.tinygguf import write_lora_adapter, write_tiny_model
from tests.support.fake_control_plane import FakeControlPlane, fake_control_plane
from tests.support.http_files import ServerStats, serve_directory
from tests.support.ports import port_block
from tests.support.waiting import stays, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        engine.find_engine() is None,
        reason="llama-server is not built (make setup builds it); these tests run the real engine",
    ),
]

REPO = Path(__file__).resolve().parents[3]
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
    for seed in (2, 3, 4):
        write_tiny_model(folder / f"model{seed}.gguf", seed=seed)
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
    """A block of ports of this test process's own, free now (tests.support.ports)."""
    low, high = port_block(size)
    return f"{low}-{high}"


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

    def state(self, replica_id: str) -> dict[str, Any]:
        """The replica's state.json, as the agent recorded it."""
        state = json.loads((self.cache / "replicas" / replica_id / "state.json").read_text())
        assert isinstance(state, dict)
        return state


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
        env: dict[str, str] | None = None,
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
                env={
                    **os.environ,
                    "PYTHONUNBUFFERED": "1",
                    "LLMGW_NODE_TOKEN": TOKEN,
                    **(env or {}),
                },
            )
        agent = AgentProcess(process, log, cache)
        self.started.append(agent)
        return agent

    def start_wanting(self, spec: dict[str, Any], *extra: str, **options: Any) -> AgentProcess:
        """Ask the control plane for ``spec`` alone, then start an agent."""
        self.plane.want([spec])
        return self.start(*extra, **options)

    def engine_pid(self, agent: AgentProcess, replica_id: str) -> int:
        pid = agent.state(replica_id)["pid"]
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
            if command is not None and command[0].endswith(engine.ENGINE_NAME):
                engine.stop_process_group(pid, grace=5)


@pytest.fixture
def agents(tmp_path: Path, plane: FakeControlPlane) -> Iterator[Agents]:
    agents = Agents(tmp_path, plane)
    try:
        yield agents
    finally:
        agents.stop_all()


class Serving(NamedTuple):
    """An agent serving one ready replica of the tiny model."""

    agent: AgentProcess
    spec: dict[str, Any]
    ready: dict[str, Any]  # the replica's report
    pid: int  # its engine's


@pytest.fixture
def serving(plane: FakeControlPlane, agents: Agents, mirror: Mirror) -> Serving:
    spec = replica_spec(mirror)
    agent = agents.start_wanting(spec)
    ready = settled(plane, spec, "ready")
    return Serving(agent, spec, ready, agents.engine_pid(agent, spec["id"]))


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


def settled(plane: FakeControlPlane, spec: dict[str, Any], state: str) -> dict[str, Any]:
    """The replica's report once it is ready or failed; it must be ``state``."""
    report = plane.wait_for(state_of(plane, spec["id"], "ready", "failed"), what=state)
    assert report["state"] == state, report["message"]
    return report


def complete(
    port: int, model: str, prompt: str = "hi", lora: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "seed": 7,
    }
    if lora is not None:
        body["lora"] = lora
    answer = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
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
    agent = agents.start_wanting(spec)

    ready = settled(plane, spec, "ready")

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
    state = agent.state(spec["id"])
    assert state["port"] == ready["port"]
    assert state["spec"]["id"] == spec["id"]
    command = state["command"]
    assert command[0] == engine.find_engine()
    assert command[command.index("--ctx-size") + 1] == "256"
    assert command[command.index("--parallel") + 1] == "1"
    # The token is in the environment, never on a command line that `ps` shows.
    assert TOKEN not in " ".join(engine.process_cmdline(agent.pid) or [])
    assert TOKEN not in " ".join(command)


def test_it_fails_a_replica_whose_download_has_the_wrong_sha256(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    wrong = "0" * 64
    spec = replica_spec(mirror, sha256=wrong)
    agent = agents.start_wanting(spec)

    failed = settled(plane, spec, "failed")

    actual = mirror.sha("model.gguf")
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
    agent = agents.start_wanting(spec)

    failed = settled(plane, spec, "failed")

    assert failed["message"] == (
        f"the adapter tiny-qwen ({adapter['source']}) cannot be used with tiny-chat: "
        "it is a LoRA adapter for qwen2, not for llama. No engine was started."
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
    agents.start_wanting(spec)

    failed = settled(plane, spec, "failed")

    assert failed["message"].startswith("the engine exited with code 1; its last output:\n")
    assert "exiting due to model loading error" in failed["message"]
    assert len(failed["message"].splitlines()) <= 16


def test_it_stops_a_replica_removed_from_the_answer(
    plane: FakeControlPlane, serving: Serving, mirror: Mirror
) -> None:
    agent, spec, ready, pid = serving

    plane.want([])
    plane.wait_for(lambda r: r["replicas"] == [], since=plane.count(), what="no replicas")

    wait_for(lambda: not engine.process_alive(pid), what="the engine to exit")
    assert not port_accepts(ready["port"])
    wait_for(
        lambda: not (agent.cache / "replicas" / spec["id"]).exists(),
        what="the replica's folder to go",
    )
    assert (agent.cache / "blobs" / mirror.sha("model.gguf")).is_file()
    assert agent.alive()


def test_it_adopts_its_engine_after_a_restart_and_stops_it_when_unwanted(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror)
    port_range = free_port_range()
    first = agents.start_wanting(spec, port_range=port_range)
    ready = settled(plane, spec, "ready")
    pid = agents.engine_pid(first, spec["id"])

    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    assert engine.process_alive(pid)
    before_restart = plane.count()
    second = agents.start(port_range=port_range)
    # The engine answers: its replica stays ready from the restarted agent's first heartbeat
    # (reported "starting", it would leave routing for that moment).
    first_report = plane.wait_for(
        lambda r: r if r["agent"]["pid"] == second.pid else None,
        since=before_restart,
        what="the restarted agent's first heartbeat",
    )
    assert plane.replica(first_report, spec["id"])["state"] == "ready"

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
    wait_for(lambda: not engine.process_alive(pid), what="the adopted engine to stop")
    assert second.alive()


def test_an_engine_with_a_key_answers_only_with_it_across_an_agent_restart(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    """The control plane names the engine's key (engine_key): the engine is started with it in
    a file of the replica's folder (mode 0600, named by --api-key-file, never on a command line
    or in state.json), the agent's own readiness checks and metrics reads send it, and an agent
    restarted over the running engine reads it back from that file: the adopted engine is ready
    at the first heartbeat and its numbers are still read."""
    key = "k3y_" + uuid.uuid4().hex
    spec = replica_spec(mirror, engine_key=key)
    port_range = free_port_range()
    first = agents.start_wanting(spec, port_range=port_range)
    ready = settled(plane, spec, "ready")
    url = f"http://127.0.0.1:{ready['port']}/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert requests.post(url, json=body, timeout=30).status_code == 401
    opened = {"Authorization": f"Bearer {key}"}
    assert requests.post(url, json=body, headers=opened, timeout=30).status_code == 200
    state = first.state(spec["id"])
    key_file = Path(state["command"][state["command"].index("--api-key-file") + 1])
    assert key_file.read_text().strip() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key not in json.dumps(state)
    pid = agents.engine_pid(first, spec["id"])
    assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    plane.wait_for(
        lambda r: (plane.replica(r, spec["id"]) or {}).get("engine"), what="the engine's numbers"
    )

    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    before_restart = plane.count()
    second = agents.start(port_range=port_range)
    first_report = plane.wait_for(
        lambda r: r if r["agent"]["pid"] == second.pid else None,
        since=before_restart,
        what="the restarted agent's first heartbeat",
    )
    assert plane.replica(first_report, spec["id"])["state"] == "ready"
    since = plane.count()
    plane.wait_for(
        lambda r: (
            (plane.replica(r, spec["id"]) or {}).get("engine")
            if r["agent"]["pid"] == second.pid
            else None
        ),
        since=since,
        what="the adopted engine's numbers",
    )
    assert agents.engine_pid(second, spec["id"]) == pid


def test_an_engine_key_that_is_not_a_plain_token_is_refused_whole() -> None:
    from llmgw.node.spec import AnswerError, ReplicaSpec

    base = {"id": "r1", "model": "m", "source": "http://x/f.gguf"}
    assert ReplicaSpec.from_json(base).engine_key is None
    assert ReplicaSpec.from_json({**base, "engine_key": "a" * 16}).engine_key == "a" * 16
    for bad in ["short", "a" * 129, "a b" * 8, "a\n" * 8, 12345678901234567, "é" * 16]:
        with pytest.raises(AnswerError, match="engine_key"):
            ReplicaSpec.from_json({**base, "engine_key": bad})
    # The key is not part of what the replica is: a spec read back from disk, without it,
    # is the same replica.
    assert ReplicaSpec.from_json({**base, "engine_key": "a" * 16}) == ReplicaSpec.from_json(base)
    assert "engine_key" not in ReplicaSpec.from_json({**base, "engine_key": "a" * 16}).to_json()


def test_it_keeps_running_through_401_garbage_and_errors(
    plane: FakeControlPlane, agents: Agents, serving: Serving
) -> None:
    agent, spec, _, pid = serving

    plane.token = "another-token"  # the node was removed
    wait_for(lambda: "does not know this node's token" in agent.output(), what="the 401 line")
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

    # The plane counts a heartbeat when it answers it; the agent logs the answer a moment later.
    for line in (
        "answered something this agent does not understand",
        "refused the heartbeat (HTTP 500): the database is down",
    ):
        wait_for(lambda line=line: line in agent.output(), what=f"the line {line!r}")
    assert agent.alive()
    assert engine.process_alive(pid)
    still = plane.wait_for(
        state_of(plane, spec["id"], "ready", "failed"), since=plane.count(), what="ready"
    )
    assert still["state"] == "ready"
    assert agents.engine_pid(agent, spec["id"]) == pid


def test_when_its_node_was_removed_it_says_so_stops_its_engines_and_exits_for_good(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    """Without --stop-engines-on-exit too: the engines of a removed node serve nobody, and no
    agent would be told to run them (issue 44, item 7)."""
    spec = replica_spec(mirror)
    agent = agents.start_wanting(spec, stop_engines_on_exit=False)
    settled(plane, spec, "ready")
    pid = agents.engine_pid(agent, spec["id"])

    said = plane.remove(by="alice", at="2026-12-07 13:02:11")

    assert agent.process.wait(timeout=30) == REMOVED_EXIT_STATUS == 78
    assert not engine.process_alive(pid)
    assert not (agent.cache / "replicas" / spec["id"]).exists()
    output = agent.output()
    assert output.count(f"the control plane at {plane.url} says: {said}") == 1
    assert "This node (node-a) was removed by alice at 2026-12-07 13:02:11 UTC" in said
    assert "stopping this node's 1 engine(s) (--keep-engines-when-removed leaves them" in output
    assert "stopped this node's engines; exiting with status 78" in output
    assert "does not know this node's token" not in output
    assert "for the next agent to adopt" not in output


def test_with_keep_engines_when_removed_its_engines_keep_running_when_its_node_was_removed(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror)
    # --stop-engines-on-exit as well: the flag about a removal is the one that decides then.
    agent = agents.start_wanting(spec, "--keep-engines-when-removed", stop_engines_on_exit=True)
    ready = settled(plane, spec, "ready")
    pid = agents.engine_pid(agent, spec["id"])

    said = plane.remove()

    assert agent.process.wait(timeout=30) == REMOVED_EXIT_STATUS
    assert engine.process_alive(pid)
    assert complete(ready["port"], MODEL)["model"] == MODEL
    assert agent.state(spec["id"])["pid"] == pid  # for an agent started later to adopt
    output = agent.output()
    assert output.count(f"the control plane at {plane.url} says: {said}") == 1
    assert "leaving this node's 1 engine(s) running, as --keep-engines-when-removed asks" in output
    assert "Exiting with status 78." in output
    assert "stopping its engine" not in output


def test_it_keeps_trying_when_the_control_plane_is_unreachable(
    plane: FakeControlPlane, agents: Agents
) -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        closed_port = placeholder.getsockname()[1]
    agent = agents.start(server=f"http://127.0.0.1:{closed_port}")

    # Never reached since it started: first a wait, as for a control plane still starting
    # (said once), then, beats later, the problem.
    wait_for(lambda: "cannot reach the control plane" in agent.output(), what="the line")
    said = agent.output()
    waiting = f"waiting for the control plane at http://127.0.0.1:{closed_port} to answer"
    assert said.count(waiting) == 1
    assert said.index(waiting) < said.index("cannot reach the control plane")
    # Time is what is tested: a closed port shows no attempt, so a few more attempts are a
    # stretch of time in which the agent keeps going and says nothing again.
    stays(
        lambda: agent.alive() and agent.output().count("cannot reach the control plane") == 1,
        seconds=0.6,
        what="the agent running, having said it once",
    )


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


def test_it_serves_the_base_model_and_each_adapter_at_its_scale_from_one_engine(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    # One adapter file under two names: at scale 0 it must change nothing, at scale 1 it must.
    adapters = [
        {"name": "tiny-sql-off", "source": mirror.source("sql.gguf"), "sha256": None, "scale": 0},
        {"name": "tiny-sql", "source": mirror.source("sql.gguf"), "sha256": None, "scale": 1},
    ]
    spec = replica_spec(mirror, adapters=adapters)
    agent = agents.start_wanting(spec)

    ready = settled(plane, spec, "ready")

    assert ready["message"] == (
        f"ready on port {ready['port']}, serving tiny-chat and its adapters "
        "tiny-sql-off (scale 0), tiny-sql (scale 1)"
    )
    port = ready["port"]
    prompt = "the quick brown fox"
    base = complete(port, MODEL, prompt, engine.lora_request(adapters, MODEL))["choices"][0]["text"]
    off = complete(port, "tiny-sql-off", prompt, engine.lora_request(adapters, "tiny-sql-off"))
    on = complete(port, "tiny-sql", prompt, engine.lora_request(adapters, "tiny-sql"))
    assert engine.lora_request(adapters, "tiny-sql") == [
        {"id": 0, "scale": 0.0},
        {"id": 1, "scale": 1.0},
    ]
    assert off["choices"][0]["text"] == base
    assert on["choices"][0]["text"] != base
    # The adapter applied to that request only: the base model answers as before after it.
    again = complete(port, MODEL, prompt, engine.lora_request(adapters, MODEL))
    assert again["choices"][0]["text"] == base
    blob = str(agent.cache / "blobs" / mirror.sha("sql.gguf"))
    command = agent.state(spec["id"])["command"]
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--lora-scaled"] == [
        f"{blob}:0",
        f"{blob}:0",
    ]


def test_it_fails_kills_and_reports_an_engine_that_stops_answering(
    plane: FakeControlPlane, serving: Serving
) -> None:
    _, spec, ready, pid = serving

    os.kill(pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        failed = plane.wait_for(
            state_of(plane, spec["id"], "failed"), timeout=15, what="the hung replica failed"
        )
        reported_after = next(
            h.received_at - stopped_at
            for h in plane.heartbeats
            if (plane.replica(h.body, spec["id"]) or {}).get("state") == "failed"
        )
        assert failed["message"] == (
            f"the engine (pid {pid}) stopped answering /health: 3 probes in a row failed "
            "(no answer within 1 s), so it is hung, stopped or deadlocked; it was killed"
        )
        assert reported_after < 8, reported_after
        wait_for(lambda: not engine.process_alive(pid), what="the hung engine killed")
        assert not port_accepts(ready["port"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def test_it_runs_slots_and_reports_the_engines_numbers(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror, slots=4)
    agent = agents.start_wanting(spec)
    ready = settled(plane, spec, "ready")
    assert ready["message"] == f"ready on port {ready['port']}, 4 slots"
    assert ready["slots"] == 4
    command = agent.state(spec["id"])["command"]
    # -c is split between the slots: each request still gets its 256 tokens.
    assert command[command.index("--ctx-size") + 1] == "1024"
    assert command[command.index("--parallel") + 1] == "4"
    slots = requests.get(f"http://127.0.0.1:{ready['port']}/slots", timeout=5).json()
    assert len(slots) == 4 and {slot["n_ctx"] for slot in slots} == {256}

    for _ in range(3):
        complete(ready["port"], MODEL, "the same prompt every time")

    def counted(report: dict[str, Any]) -> dict[str, Any] | None:
        numbers = (plane.replica(report, spec["id"]) or {}).get("engine") or {}
        # Tokens per second is over the time between two readings, so it comes second.
        counted = numbers.get("predicted_tokens", 0) >= 24 and "tokens_per_second" in numbers
        return numbers if counted else None

    numbers = plane.wait_for(counted, timeout=15, what="the engine's numbers")
    assert numbers["slots"] == 4
    assert numbers["prompt_tokens_cached"] > 0  # the repeated prompt came from the cache
    assert numbers["requests_processing"] == 0
    assert numbers["tokens_per_second"] >= 0


def test_it_reads_its_token_from_a_file(
    plane: FakeControlPlane, agents: Agents, tmp_path: Path
) -> None:
    token_file = tmp_path / "node-token"
    token_file.write_text(TOKEN + "\n")
    agent = agents.start("--token-file", str(token_file), env={"LLMGW_NODE_TOKEN": "wrong"})

    plane.wait_for(lambda r: True, what="a heartbeat")

    assert plane.heartbeats[-1].authorization == f"Bearer {TOKEN}"
    assert "does not know this node's token" not in agent.output()


def test_it_refuses_to_start_without_a_token_and_takes_none_in_argv(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_NODE_TOKEN"}
    base = [sys.executable, "-m", "llmgw", "node", "--server", "http://127.0.0.1:9"]
    base += ["--memory", "1", "--cores", "1", "--cache", str(tmp_path / "c")]

    missing = subprocess.run(base, env=env, capture_output=True, text=True, timeout=30)
    in_argv = subprocess.run(
        [*base, "--token", TOKEN], env=env, capture_output=True, text=True, timeout=30
    )
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty_file = subprocess.run(
        [*base, "--token-file", str(empty)], env=env, capture_output=True, text=True, timeout=30
    )

    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "llmgw node: give this node's token in LLMGW_NODE_TOKEN or in a file named by "
        "--token-file; the control plane gives one when the node is registered."
    )
    assert in_argv.returncode == 1
    assert in_argv.stderr.strip() == (
        "llmgw node: --token is not taken: a command line is visible to every user of the "
        "machine (ps). Put the token in LLMGW_NODE_TOKEN or in a file named by --token-file."
    )
    assert empty_file.returncode == 1
    assert empty_file.stderr.strip() == f"llmgw node: the token file {empty} is empty."


def test_it_fails_a_replica_whose_engine_dies_after_it_was_ready(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror)
    agent = agents.start_wanting(spec)
    settled(plane, spec, "ready")

    os.kill(agents.engine_pid(agent, spec["id"]), signal.SIGKILL)

    failed = plane.wait_for(state_of(plane, spec["id"], "failed"), what="failed")
    assert failed["message"].startswith(
        "the engine was killed by signal 9 (SIGKILL); its last output:\n"
    )
    assert "stop processing" in failed["message"]  # the readiness check, in the engine log


def test_it_stops_an_engine_that_is_not_ready_in_time(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    spec = replica_spec(mirror)
    # The engine takes about a second to import and load; give it a tenth of that.
    agent = agents.start_wanting(spec, "--ready-timeout", "0.1")

    failed = settled(plane, spec, "failed")

    assert failed["message"].startswith(
        "the engine did not become ready within 0.1 s; its last output:\n"
    )
    state = agent.state(spec["id"])
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


def test_it_keeps_its_cache_within_bounds_evicting_least_recently_used_unneeded_files(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror
) -> None:
    size = (mirror.files / "model.gguf").stat().st_size
    # Room for two of the four model files (each about half a megabyte), not three.
    agent = agents.start("--cache-max-gb", f"{2.5 * size / 1e9:.6f}")
    blobs = agent.cache / "blobs"

    def settle(*specs: dict[str, Any], keep: list[dict[str, Any]] | None = None) -> None:
        plane.want(list(specs), keep=keep)
        for spec in specs:
            settled(plane, spec, "ready")
        plane.wait_for(lambda r: True, since=plane.count() + 2, what="two more heartbeats")

    first = replica_spec(mirror)
    settle(first)
    second = replica_spec(mirror, source=mirror.source("model2.gguf"), sha256=None)
    settle(second)  # the first is stopped; its weights stay while there is room
    assert {p.name for p in blobs.iterdir()} == {
        mirror.sha("model.gguf"),
        mirror.sha("model2.gguf"),
    }

    third = replica_spec(mirror, source=mirror.source("model3.gguf"), sha256=None)
    settle(second, third)

    # The least recently used file no replica needs went; the ones in use stayed.
    assert {p.name for p in blobs.iterdir()} == {
        mirror.sha("model2.gguf"),
        mirror.sha("model3.gguf"),
    }
    assert mirror.source("model.gguf") not in json.loads((agent.cache / "urls.json").read_text())
    assert f"cache: evicted {mirror.sha('model.gguf')}" in agent.output()

    # A previous revision the control plane asks to keep stays, though older and unused.
    fourth = replica_spec(mirror, source=mirror.source("model4.gguf"), sha256=None)
    settle(fourth, keep=[{"source": mirror.source("model2.gguf"), "sha256": None}])
    assert {p.name for p in blobs.iterdir()} == {
        mirror.sha("model2.gguf"),
        mirror.sha("model4.gguf"),
    }


def test_it_rotates_an_engines_log(plane: FakeControlPlane, agents: Agents, mirror: Mirror) -> None:
    spec = replica_spec(mirror)
    agent = agents.start_wanting(spec, "--engine-log-max-mb", "0.002")
    ready = settled(plane, spec, "ready")
    folder = agent.cache / "replicas" / spec["id"]

    # The engine logs each request; enough of them pass 2 kB.
    for _ in range(10):
        complete(ready["port"], MODEL)
    wait_for(lambda: (folder / "engine.log.1").exists(), timeout=20, what="a rotated log")

    assert (folder / "engine.log").stat().st_size < (folder / "engine.log.1").stat().st_size
    assert "rotated its engine log" in agent.output()
    complete(ready["port"], MODEL)
    wait_for(lambda: (folder / "engine.log").stat().st_size > 0, what="logging to go on")
