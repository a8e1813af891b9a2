"""End to end: a model with an autoscale policy, its requests queued through two gateway
"machines" (two gateway process groups, each with a folder of its own, on one database), gets a
second replica that serves, and gives it back once the load is gone, with no failed request.

Real processes throughout: the run command's gateway, web, worker and beat, a second gateway,
a node agent and llama.cpp engines on a tiny generated model."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest
import requests

from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support.http_files import serve_directory
from tests.support.system import System, free_port, run_python, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("weights")
    write_tiny_model(folder / "tiny.gguf", seed=3)
    with serve_directory(folder) as (base_url, _stats):
        yield base_url


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, weights: str) -> Iterator[System]:
    folder = tmp_path_factory.mktemp("system")
    running = System(folder, allowed_hosts=[urlsplit(weights).netloc])
    with running.running():
        running.add_node("node-a", memory_gb=4, cores=4)
        running.wait_for_ready_nodes()
        # A second machine's gateway: its own folder (its own fair queue and load maps), the
        # same database.
        from llmgw_site.management.commands.llmgw_run import gateway_command

        running.second_port = free_port()  # type: ignore[attr-defined]
        env = {**running.env, "LLMGW_VAR_DIR": str(folder / "var-2")}
        bin_dir = Path(sys.executable).parent
        port = running.second_port  # type: ignore[attr-defined]
        running._spawn("gateway-2", gateway_command(bin_dir, "127.0.0.1", port, workers=1), env=env)
        yield running


class Load:
    """`clients` threads, each sending one long completion after another through `urls` (in
    turn), until stopped; every answer's status is kept."""

    def __init__(self, urls: list[str], key: str, clients: int, tokens: int) -> None:
        self.urls, self.key, self.tokens = urls, key, tokens
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]

    def _run(self, number: int) -> None:
        url = self.urls[number % len(self.urls)]
        while not self.stop.is_set():
            try:
                response = requests.post(
                    f"{url}/v1/completions",
                    json={
                        "model": "busy",
                        "prompt": "count",
                        "max_tokens": self.tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                    headers=auth(self.key),
                    timeout=120,
                )
                self.statuses.append(response.status_code)
                if response.status_code != 200:
                    self.errors.append(f"{response.status_code} {response.text[:200]}")
            except requests.RequestException as exc:
                self.errors.append(repr(exc))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=150)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def target(system: System) -> dict[str, Any]:
    return system.api("GET", "models/busy/target")


def routable(system: System) -> int:
    return sum(1 for r in target(system)["replicas"] if r["routable"])


def writers_by_machine(system: System) -> set[str]:
    """The machines (the run command's gateway, the second one) whose processes wrote a fresh
    queue row, told apart by the pids in the rows' writer names."""
    script = (
        "import django; django.setup(); from datetime import timedelta; "
        "from django.utils import timezone; from fleet.models import LoadSignal; "
        "fresh = LoadSignal.objects.filter(at__gte=timezone.now() - timedelta(seconds=20)); "
        "print(' '.join(fresh.values_list('writer', flat=True)))"
    )
    env = {**system.env, "DJANGO_SETTINGS_MODULE": "llmgw_site.settings"}
    done = run_python(script, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    pids = {int(w.split("-")[-2]) for w in done.stdout.split()}
    machines = set()
    for name in ("gateway", "gateway-2"):
        root = psutil.Process(system.processes[name].pid)
        tree = {root.pid, *(c.pid for c in root.children(recursive=True))}
        if pids & tree:
            machines.add(name)
    return machines


def test_queued_requests_on_two_gateways_add_a_replica_and_an_idle_one_goes(
    system: System, tmp_path: Path, weights: str
) -> None:
    definition = {
        "name": "busy",
        "source": f"{weights}/tiny.gguf",
        "context_length": 2048,
        "min_replicas": 1,
        "max_replicas": 2,
        "profiles": [{"name": "cpu", "memory_gb": 1, "cores": 1, "slots": 1}],
        "autoscale": {"wait": "1s", "up_after": "10s", "down_after": "10s"},
    }
    system.api("POST", "models", json=definition)
    wait_for(lambda: routable(system) == 1, timeout=90, what="the first replica of busy")
    key = system.api("POST", "keys", json={"name": "autoscale-e2e"})["key"]
    urls = [system.url, f"http://127.0.0.1:{system.second_port}"]  # type: ignore[attr-defined]
    wait_for(
        lambda: requests.get(f"{urls[1]}/v1/models", headers=auth(key), timeout=2).ok,
        timeout=60,
        what="the second gateway",
    )

    # Six clients on one slot: each waits for the five ahead of it, about a second apiece.
    with Load(urls, key, clients=6, tokens=1500) as load:
        wait_for(
            lambda: routable(system) == 2,
            timeout=120,
            interval=0.5,
            what=f"a second replica, added by the policy ({target(system)['why']})",
        )
        assert writers_by_machine(system) == {"gateway", "gateway-2"}
        [step] = system.api("GET", "audit", params={"model": "busy", "action": "autoscale"})[
            "entries"
        ][:1]
        assert step["actor"] == "system" and step["note"].startswith("up to 2: queue wait p50")
    assert load.errors == [] and load.statuses

    # One client at a time needs one replica: the other is given back, drained.
    with Load(urls[:1], key, clients=1, tokens=200) as trickle:
        wait_for(
            lambda: routable(system) == 1 and len(target(system)["replicas"]) == 1,
            timeout=120,
            interval=0.5,
            what=f"the spare replica to go ({target(system)['why']})",
        )
    assert trickle.errors == [] and trickle.statuses
    entries = system.api("GET", "audit", params={"model": "busy", "action": "autoscale"})
    assert entries["entries"][0]["note"].startswith("down to 1")
