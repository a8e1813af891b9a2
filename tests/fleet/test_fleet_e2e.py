"""End to end: the control plane, a Celery worker with beat, and two node agents running the real
llama.cpp server on tiny generated models, all as processes on 127.0.0.1, driven by `llmgw ctl`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
import yaml

from llmgw.cli import main
from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support.http_files import serve_directory
from tests.support.system import System, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("weights")
    write_tiny_model(folder / "tiny.gguf", seed=1)
    with serve_directory(folder) as (base_url, _stats):
        yield base_url


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, weights: str) -> Iterator[System]:
    running = System(tmp_path_factory.mktemp("system"), allowed_hosts=[urlsplit(weights).netloc])
    with running.running():
        running.add_node("node-a", memory_gb=3, cores=2)
        running.add_node("node-b", memory_gb=2, cores=2)
        running.wait_for_ready_nodes()
        yield running


@pytest.fixture
def ctl(system: System, capsys: Any, monkeypatch: Any) -> Any:
    monkeypatch.setenv("LLMGW_URL", system.url)
    monkeypatch.setenv("LLMGW_TOKEN", system.token)

    def run(*argv: str) -> str:
        code = main(["ctl", *argv])
        out, err = capsys.readouterr()
        assert code == 0, err
        return out

    return run


def define(tmp_path: Path, weights: str, name: str, **fields: Any) -> str:
    data = {
        "name": name,
        "source": f"{weights}/tiny.gguf",
        "context_length": 256,
        "profiles": [{"name": "cpu", "memory_gb": 1, "cores": 1}],
        **fields,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def target(system: System, name: str) -> dict[str, Any]:
    return system.api("GET", f"models/{name}/target")


def ready_replicas(system: System, name: str) -> list[dict[str, Any]]:
    return [r for r in target(system, name)["replicas"] if r["routable"]]


def wait_ready(system: System, name: str, count: int, timeout: float = 90) -> list[dict[str, Any]]:
    def enough() -> list[dict[str, Any]] | None:
        t = target(system, name)
        ready = [r for r in t["replicas"] if r["routable"]]
        placed = [r for r in t["replicas"] if r["state"] != "withdrawn"]
        return ready if len(ready) == count and len(placed) == count else None

    return wait_for(enough, timeout=timeout, what=f"{count} ready replica(s) of {name}")


def complete(system: System, replica: dict[str, Any], model: str) -> str:
    """A completion asked of the replica's engine itself, with its key."""
    response = requests.post(
        f"http://127.0.0.1:{replica['port']}/v1/completions",
        json={"model": model, "prompt": "hello", "max_tokens": 4},
        headers={"Authorization": f"Bearer {system.engine_key(replica)}"},
        timeout=30,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def test_a_model_becomes_ready_and_answers(
    system: System, ctl: Any, tmp_path: Path, weights: str
) -> None:
    out = ctl("model", "add", "-f", define(tmp_path, weights, "chat"))
    assert "Source is there:" in out
    [replica] = wait_ready(system, "chat", 1)
    assert isinstance(complete(system, replica, "chat"), str)
    listing = ctl("models")
    assert listing.splitlines()[1].split()[:2] == ["chat", "1/1"]
    nodes = ctl("nodes")
    assert "node-a" in nodes and "node-b" in nodes


def node_heartbeats(system: System, kind: str, answer: str) -> float:
    """llmgw_node_heartbeats_total{kind, answer} from the gateway's /metrics (every process's)."""
    text = requests.get(f"{system.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name == "llmgw_node_heartbeats_total":
            labels, _, value = rest.rpartition(" ")
            if f'kind="{kind}"' in labels and f'answer="{answer}"' in labels:
                total += float(value)
    return total


def test_idle_agents_renew_at_the_gateway_and_a_change_still_reaches_them(
    system: System, ctl: Any
) -> None:
    """With nothing changing on the nodes, their agents renew and the gateway answers them itself;
    the nodes stay alive on renewals alone. A change of what a node runs (a second replica) still
    arrives, by the answer to a renewal that names the older generation."""
    wait_ready(system, "chat", 1)
    renewed = node_heartbeats(system, "renewal", "unchanged")
    heard = {n["name"]: n["last_heartbeat"] for n in system.api("GET", "nodes")}

    def kept_alive_by_renewals() -> dict[str, str] | None:
        if node_heartbeats(system, "renewal", "unchanged") < renewed + 4:
            return None
        later = {n["name"]: n["last_heartbeat"] for n in system.api("GET", "nodes")}
        return later if all(later[name] > heard[name] for name in heard) else None

    wait_for(
        kept_alive_by_renewals,
        timeout=10,  # several intervals of 2 s
        what="four renewals the gateway answered, and every node's last heartbeat moved on",
    )
    changed = node_heartbeats(system, "renewal", "changed")
    ctl("scale", "chat", "--min", "2")
    wait_ready(system, "chat", 2)
    assert node_heartbeats(system, "renewal", "changed") > changed


def test_scaling_up_spreads_and_scaling_down_stops(system: System, ctl: Any) -> None:
    ctl("scale", "chat", "--min", "2")
    ready = wait_ready(system, "chat", 2)
    assert sorted(r["node"] for r in ready) == ["node-a", "node-b"]
    ctl("scale", "chat", "--min", "1")
    wait_ready(system, "chat", 1)


def test_a_restart_replaces_replicas_with_one_ready_at_every_moment(
    system: System, ctl: Any
) -> None:
    ctl("scale", "chat", "--min", "2")
    before = {r["id"] for r in wait_ready(system, "chat", 2)}
    out = ctl("restart", "--model", "chat")
    assert "one replica at a time" in out

    def restarted() -> bool:
        """The restart done; fails at once if a look finds no replica ready."""
        t = target(system, "chat")
        ready = [r for r in t["replicas"] if r["routable"]]
        assert ready, f"no ready replica during the restart: {t['replicas']}"
        return (
            len(ready) == 2
            and not before & {r["id"] for r in ready}
            and all(r["up_to_date"] for r in ready)
        )

    wait_for(
        restarted,
        timeout=120,
        interval=0.2,
        what="the restart to finish: two ready, up-to-date replicas, none of those before",
    )
    assert all(r["generation"] == 1 for r in ready_replicas(system, "chat"))


def test_a_hung_engine_is_withdrawn_within_10_s_and_replaced(system: System, ctl: Any) -> None:
    ctl("scale", "chat", "--min", "1")
    [replica] = wait_ready(system, "chat", 1)
    state = system.folder / "nodes" / replica["node"] / "replicas" / replica["id"] / "state.json"
    pid = int(json.loads(state.read_text())["pid"])

    os.kill(pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        wait_for(
            lambda: replica["id"] not in {r["id"] for r in ready_replicas(system, "chat")},
            timeout=10,
            interval=0.1,
            what="the hung replica to leave routing",
        )
        print(f"withdrawn from routing {time.monotonic() - stopped_at:.1f} s after the hang")
        hung = next(r for r in target(system, "chat")["replicas"] if r["id"] == replica["id"])
        reason = hung["message"] or hung["withdraw_reason"]
        assert "stopped answering /health" in reason, hung
        [again] = wait_ready(system, "chat", 1)
        assert again["id"] != replica["id"]
        assert complete(system, again, "chat") is not None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def test_killing_an_agent_moves_its_replicas(system: System, ctl: Any) -> None:
    ctl("scale", "chat", "--min", "1")
    [replica] = wait_ready(system, "chat", 1)
    victim = replica["node"]
    system.stop_process(f"node-{victim}", signal.SIGKILL)
    wait_for(
        lambda: any(
            n["name"] == victim and n["state"] == "lost" for n in system.api("GET", "nodes")
        ),
        timeout=30,
        what=f"{victim} to be marked lost",
    )
    [moved] = wait_ready(system, "chat", 1)
    assert moved["node"] != victim
    assert complete(system, moved, "chat") is not None
    # The node comes back: a new agent on the same cache adopts or stops what the old one left.
    token = system.api("POST", "nodes", json={"name": f"{victim}-2"})["token"]
    system.start_agent(f"{victim}-2", token, memory_gb=2, cores=2)
    wait_for(
        lambda: any(
            n["name"] == f"{victim}-2" and n["state"] == "ready" for n in system.api("GET", "nodes")
        ),
        what="the replacement node",
    )


def test_a_lower_class_is_preempted_for_a_critical_model(
    system: System, ctl: Any, tmp_path: Path, weights: str
) -> None:
    ctl("scale", "chat", "--min", "0", "--max", "0")
    wait_for(
        lambda: (
            not system.api("GET", "nodes")[0]
            or all(not n["replicas"] for n in system.api("GET", "nodes"))
        ),
        what="chat's replicas to stop",
    )
    # Room for this many 1 GB / 1 core replicas on the live nodes:
    free = sum(
        min(n["free"]["memory_gb"], n["free"]["cores"])
        for n in system.api("GET", "nodes")
        if n["state"] == "ready"
    )
    ctl(
        "model",
        "add",
        "-f",
        define(tmp_path, weights, "filler", min_replicas=int(free), **{"class": "opportunistic"}),
    )
    wait_ready(system, "filler", int(free))
    ctl("model", "add", "-f", define(tmp_path, weights, "vip", **{"class": "critical"}))
    wait_ready(system, "vip", 1)
    # One filler replica made room; the rest keep serving, and the one that no longer fits waits.
    wait_ready(system, "filler", int(free) - 1)
    assert target(system, "filler")["unplaced"][0]["count"] == 1
    audit = system.api("GET", "audit", params={"action": "preempt"})["entries"]
    assert (
        audit
        and audit[0]["model"] == "filler"
        and audit[0]["actor"] == "system"
        and "vip" in audit[0]["note"]
    )


def cordoned_agent(
    system: System, ctl: Any, tmp_path: Path, name: str, *options: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """A real agent for a new node `name` (its options added), and the file of its output. The
    node is cordoned, so that nothing is placed on it and the other tests' nodes stay as they
    were."""
    token = system.api("POST", "nodes", json={"name": name})["token"]
    ctl("node", "cordon", name)
    log = tmp_path / f"{name}.log"
    argv = [
        *(sys.executable, "-m", "llmgw", "node", "--server", system.url),
        *("--memory", "1", "--cores", "1", *options),
        *("--cache", str(tmp_path / "cache"), "--heartbeat-interval", "1"),
    ]
    with log.open("ab") as output:
        agent = subprocess.Popen(
            argv,
            env={**system.env, "LLMGW_NODE_TOKEN": token},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    return agent, log


def test_an_agent_naming_another_address_is_refused_until_staff_allow_it(
    system: System, ctl: Any, tmp_path: Path, outward_address: str
) -> None:
    """A real agent whose engines would listen on this machine's outward address, while it
    reaches the control plane over loopback: the control plane sees 127.0.0.1 and refuses that
    address until staff allow it for the node."""
    address = outward_address
    agent, log = cordoned_agent(system, ctl, tmp_path, "node-c", "--address", address)

    def node_c() -> dict[str, Any]:
        return next(n for n in system.api("GET", "nodes") if n["name"] == "node-c")

    try:
        wait_for(
            lambda: "refused the heartbeat (HTTP 403)" in log.read_text(),
            what=f"the agent to log its refusal (log: {log})",
        )
        assert (
            f"This node reports its engines at {address}, but it connects from 127.0.0.1"
            in log.read_text()
        )
        assert node_c()["state"] == "waiting for its agent"

        ctl("node", "set", "node-c", "--address-allow", address)
        wait_for(lambda: node_c()["state"] == "cordoned", what="node-c's heartbeat to be taken")
        assert node_c()["address"] == address
    finally:
        agent.terminate()
        agent.wait(timeout=20)
        ctl("node", "remove", "node-c")


def test_a_removed_nodes_agent_hears_who_removed_it_through_the_gateway_and_exits_for_good(
    system: System, ctl: Any, tmp_path: Path
) -> None:
    """A real agent renewing through the gateway: once the node is removed, the gateway's copy
    of the nodes drops it, its renewal goes on to the web, which answers 410 (who, when), and
    the agent exits with the status its systemd unit does not restart (issue 44, item 7)."""
    agent, log = cordoned_agent(system, ctl, tmp_path, "node-r")
    try:
        wait_for(
            lambda: any(
                n["name"] == "node-r" and n["state"] == "cordoned"
                for n in system.api("GET", "nodes")
            ),
            what=f"node-r's first heartbeat (log: {log})",
        )
        ctl("node", "remove", "node-r")
        assert agent.wait(timeout=30) == 78, log.read_text()
    finally:
        if agent.poll() is None:
            agent.terminate()
            agent.wait(timeout=20)
    said = log.read_text()
    assert re.search(
        rf"the control plane at {re.escape(system.url)} says: This node \(node-r\) was removed "
        r"by \S+ at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC",
        said,
    ), said
    assert "stopped this node's engines; exiting with status 78" in said
    assert "does not know this node's token" not in said
