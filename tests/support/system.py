"""A whole llmgw running as real processes, for end-to-end tests.

`System` starts the gateway (uvicorn's workers, on the public port; it forwards everything but /v1/
and /metrics to the web), the web process (gunicorn, on a port of its own), a Celery worker with
beat, and node agents, each
as a child process on 127.0.0.1, on a database of its own (a fresh PostgreSQL database when
DATABASE_URL names PostgreSQL, else a SQLite file) and Redis when REDIS_URL is set (else the
filesystem broker). Everything it starts is stopped by pid when it closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
import yaml

from tests.support import waiting
from tests.support.ports import free_port, port_block

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ROOT", "System", "free_port", "run_python", "wait_for"]


def run_python(
    script: str, *args: str, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """`python -c script args` in a process of its own, from the repository; its output as text."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for(
    check: Callable[[], Any], *, timeout: float = 60, interval: float = 0.1, what: str = "condition"
) -> Any:
    """tests.support.waiting.wait_for, looking every 0.1 s: most checks here ask a process of
    the system over HTTP, which a look every 0.02 s would keep busy."""
    return waiting.wait_for(check, timeout=timeout, interval=interval, what=what)


class _Database:
    """A database for one system: created on open, dropped on close."""

    def __init__(self, folder: Path) -> None:
        base = os.environ.get("DATABASE_URL", "")
        self.admin_url: str | None = None
        if base.startswith(("postgres://", "postgresql://")):
            parts = urlsplit(base)
            self.name = f"llmgw_it_{uuid.uuid4().hex[:10]}"
            self.admin_url = urlunsplit(parts._replace(path="/postgres"))
            self.url = urlunsplit(parts._replace(path=f"/{self.name}"))
            self._run(f'CREATE DATABASE "{self.name}"')
        else:
            self.url = f"sqlite:///{folder / 'llmgw.sqlite3'}"

    def _run(self, sql: str) -> None:
        import psycopg

        assert self.admin_url
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql)

    def drop(self) -> None:
        if self.admin_url:
            self._run(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


class System:
    def __init__(
        self,
        folder: Path,
        *,
        config: dict[str, Any] | None = None,
        allowed_hosts: list[str] | None = None,
    ) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database = _Database(folder)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        cluster = {
            "reconcile_interval": "1s",
            "node_lost_after": "6s",
            "default_idle_timeout": "15m",
        }
        server_yaml = {"cluster": cluster, **(config or {})}
        (folder / "server.yaml").write_text(yaml.safe_dump(server_yaml))
        self.env = {
            **{
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("DJANGO", "LLMGW", "PYTEST"))
            },
            "DATABASE_URL": self.database.url,
            "LLMGW_VAR_DIR": str(folder / "var"),
            "LLMGW_CONFIG": str(folder / "server.yaml"),
            "LLMGW_PUBLIC_URL": self.url,
            "LLMGW_METRICS_DIR": str(folder / "metrics"),
            # Tests read /metrics without a scrape token (the gateway's own tests check tokens).
            "LLMGW_METRICS_OPEN": "true",
            "LLMGW_CELERY_QUEUE": f"llmgw-it-{uuid.uuid4().hex[:8]}",
            "LLMGW_SECRET_KEY": "test-secret-key-for-an-end-to-end-system",
            "LLMGW_SOURCE_ALLOWED_HOSTS": ",".join(
                [f"127.0.0.1:{self.port}", *(allowed_hosts or [])]
            ),
        }
        self.token = ""
        self.admin_password = ""
        self.agents_started = 0
        self.agent_ports: dict[str, tuple[int, int]] = {}  # by node: the last agent's range

    # -- processes ------------------------------------------------------------------

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = self.folder / f"{name}.log"
        self.logs[name] = log
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env or self.env,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.processes[name] = process
        return process

    def manage(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def start(self, *, worker: bool = True) -> System:
        self.manage("migrate", "--verbosity", "0")
        out = self.manage("llmgw_admin")
        # Printed once, when the admin account is made: only their hashes are kept.
        self.token = re.search(r"LLMGW_TOKEN=(\w+)", out).group(1)  # type: ignore[union-attr]
        self.admin_password = re.search(r"password (\S+)\)", out).group(1)  # type: ignore[union-attr]
        bin_dir = Path(sys.executable).parent
        web_port = free_port()
        from llmgw_site.management.commands.llmgw_run import (
            behind_gateway_environment,
            web_command,
        )

        self.env.update(behind_gateway_environment(f"127.0.0.1:{web_port}"))
        self.start_gateway()
        self._spawn("web", web_command(bin_dir, f"127.0.0.1:{web_port}", timeout=120))
        if worker:
            self.start_worker()
            self.start_beat()
        wait_for(
            lambda: requests.get(f"{self.url}/api/v1/models", headers=self.headers, timeout=2).ok,
            timeout=60,
            what=f"the web process on {self.url} (log: {self.logs['web']})",
        )
        return self

    @contextlib.contextmanager
    def running(self, *, worker: bool = True) -> Iterator[System]:
        """Started for the block (a fixture's `with system.running(): ... yield system`), closed
        after it; where the block fails, the processes' last log lines are printed first."""
        try:
            yield self.start(worker=worker)
        except BaseException:
            print(self.log_tail())
            raise
        finally:
            self.close()

    def start_gateway(self, workers: int = 2) -> None:
        from llmgw_site.management.commands.llmgw_run import gateway_command

        bin_dir = Path(sys.executable).parent
        self._spawn("gateway", gateway_command(bin_dir, "127.0.0.1", self.port, workers=workers))

    def start_worker(self) -> None:
        from llmgw_site.management.commands.llmgw_run import worker_command

        self._spawn("worker", worker_command(Path(sys.executable).parent))

    def start_beat(self) -> None:
        from llmgw_site.management.commands.llmgw_run import beat_command

        bin_dir = Path(sys.executable).parent
        self._spawn("beat", beat_command(bin_dir, self.folder / "beat-schedule"))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}"}

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = requests.request(
            method, f"{self.url}/api/v1/{path}", headers=self.headers, timeout=30, **kwargs
        )
        assert response.ok, f"{method} {path}: {response.status_code} {response.text}"
        return response.json() if response.content else None

    def add_node(self, name: str, *, memory_gb: float, cores: int, start: bool = True) -> str:
        token = self.api("POST", "nodes", json={"name": name})["token"]
        if start:
            self.start_agent(name, token, memory_gb=memory_gb, cores=cores)
        return token

    def add_ready_nodes(self, *, memory_gb: float, cores: int, names: tuple[str, ...]) -> None:
        """Nodes alike, each with its agent, once every agent has sent its first heartbeat."""
        for name in names:
            self.add_node(name, memory_gb=memory_gb, cores=cores)
        self.wait_for_ready_nodes()

    def wait_for_ready_nodes(self) -> None:
        wait_for(
            lambda: all(n["state"] == "ready" for n in self.api("GET", "nodes")),
            what="every agent's first heartbeat",
        )

    def start_agent(
        self,
        name: str,
        token: str,
        *,
        memory_gb: float,
        cores: int,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        same_ports: bool = False,
    ) -> subprocess.Popen[bytes]:
        """An agent for node `name`; `env` and `args` are added to its environment and its
        command line (a GPU machine's fake nvidia-smi and engine, say). With `same_ports`, the
        port range of the last agent started for `name` (a node started again as systemd would,
        same command line: it adopts the engines its predecessor left on those ports)."""
        cache = self.folder / "nodes" / name
        # Otherwise each agent ever started here gets ports of its own: an agent killed in a
        # test may leave engines holding its ports, and a later agent must not be handed them.
        self.agents_started += 1
        if not same_ports:
            self.agent_ports[name] = port_block(100)
        first, last = self.agent_ports[name]
        argv = [
            sys.executable,
            "-m",
            "llmgw",
            "node",
            "--server",
            self.url,
            "--memory",
            str(memory_gb),
            "--cores",
            str(cores),
            "--cache",
            str(cache),
            "--port-range",
            f"{first}-{last}",
            "--heartbeat-interval",
            "1",
            "--ready-timeout",
            "60",
            "--stop-engines-on-exit",
            *args,
        ]
        # The token goes in the environment: a command line is visible to everyone in `ps`.
        environment = {**self.env, **(env or {}), "LLMGW_NODE_TOKEN": token}
        return self._spawn(f"node-{name}", argv, env=environment)

    def stop_process(self, name: str, sig: int = signal.SIGTERM) -> None:
        process = self.processes.pop(name)
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def engine_key(self, replica: dict[str, Any]) -> str:
        """The key a replica's engine was started with (every request to it but /health sends
        it), from the replica's folder on its node; replica as the API's target lists it."""
        folder = self.folder / "nodes" / replica["node"] / "replicas" / replica["id"]
        return (folder / "engine.key").read_text().strip()

    def engine_pids(self) -> list[int]:
        """Engines the agents wrote down (their state files), for a last clean-up by pid."""
        pids = []
        for state in (self.folder / "nodes").glob("*/replicas/*/state.json"):
            try:
                pids.append(int(json.loads(state.read_text())["pid"]))
            except (OSError, ValueError, KeyError):
                continue
        return pids

    def stop_processes(self, names: list[str], sig: int = signal.SIGTERM) -> None:
        """stop_process for each at once: all are signalled, then each is waited for."""
        stopping = {name: self.processes.pop(name) for name in names}
        for process in stopping.values():
            if process.poll() is None:
                process.send_signal(sig)
        for process in stopping.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def close(self) -> None:
        # As the run command stops: the nodes first (they stop their engines), then the rest.
        self.stop_processes([n for n in self.processes if n.startswith("node-")])
        self.stop_processes(list(self.processes))
        for pid in self.engine_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        self.database.drop()

    def log_tail(self, lines: int = 40) -> str:
        out = []
        for name, path in self.logs.items():
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            out.append(f"--- {name} ---\n" + "\n".join(text))
        return "\n".join(out)
