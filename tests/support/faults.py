"""A fault matrix over a whole llmgw: one fault at a random moment of one operation, traffic through
the gateway the whole time, then the invariants that must hold once the faulty part is back.

`Fleet` runs the product as real processes (tests.support.system) on a PostgreSQL server and a
redis-server of its own (never the machine's), with two node agents running llama.cpp replicas of
a model "chat" that the traffic asks all along. `run_cell(fleet, fault, operation, rng)` starts the
operation, injects the fault after a random delay drawn from `rng`, restarts what was killed the way
an operator (or systemd) would, and checks:

- the operation completes, or ends recorded as failed with a reason (else it is "lost");
- no replica is placed twice: no more placed replicas than asked for, no two on one node and port;
- no engine (llama-server) under the fleet's folder is left running that no replica owns;
- the audit records the operation;
- no request failed other than those the fault may fail: requests in flight on a killed gateway
  worker (a dropped connection) or sent while a killed engine was still routed (an answer with a
  status and an OpenAI error body). A request that hangs (the client's timeout) always counts.

The faults (`FAULTS`):
- web: the gunicorn master and its workers (SIGKILL to each), started again with the same command.
- gateway-worker: one of uvicorn's worker processes (SIGKILL); uvicorn's supervisor starts another.
- worker: the Celery worker and everything under it (SIGKILL), started again.
- beat: the beat process (SIGKILL), the one that holds the beat lease, started again as the run
  command starts it (it runs beside the worker). Then (and after worker, postgres, redis) the
  schedule must be sending periodic tasks again.
- node: one node agent (SIGKILL; its engines keep running), started again on the same cache and
  token, where it adopts or stops what the killed agent left.
- engine: the llama-server of one ready replica of "chat" (SIGKILL); the agent and the reconciler
  replace it, nothing is restarted by hand.
- postgres: the fleet's PostgreSQL stopped (fast shutdown) and started again.
- redis: the fleet's redis-server stopped (an empty one comes back, as after a restart without
  persistence).

The seed: LLMGW_FAULT_SEED replays a run (the tests and bench/faults.py print it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import requests

from llmgw.tinygguf import write_tiny_model
from tests.support import postgres
from tests.support.http_files import serve_directory
from tests.support.redis_server import RedisServer
from tests.support.system import ROOT, System, wait_for

FAULTS = ("web", "gateway-worker", "worker", "beat", "node", "engine", "postgres", "redis")
# After a fault that stops the schedule, a periodic task is sent again within this long
# (the beat lease, 15 s, plus the 1 s reconcile interval and some slack).
SCHEDULE_BACK_SECONDS = 25.0
OPERATIONS = ("scale", "add")
PROFILE = [{"name": "cpu", "memory_gb": 1, "cores": 1}]
NODES = ("node-a", "node-b")
# How long a killed process stays down before it is started again, and a stopped server.
DOWN_SECONDS = {"postgres": 5.0, "redis": 3.0}
DEFAULT_DOWN_SECONDS = 2.0
# The fault lands this long at most after the operation was asked for.
LATEST_FAULT_SECONDS = 3.0
OPERATION_TIMEOUT = 150.0
CLIENT_TIMEOUT = 30.0


def seed_from_environment() -> int:
    """LLMGW_FAULT_SEED when set (to replay a run), else a new one."""
    given = os.environ.get("LLMGW_FAULT_SEED", "").strip()
    return int(given) if given else random.SystemRandom().randrange(1, 10**6)


def all_cells() -> list[tuple[str, str]]:
    return [(fault, operation) for fault in FAULTS for operation in OPERATIONS]


def sample_cells(rng: random.Random, wanted: str) -> list[tuple[str, str]]:
    """`wanted` is a number of cells drawn by `rng`, or named cells: "web:add,engine:scale"."""
    if wanted.strip().isdigit():
        return rng.sample(all_cells(), int(wanted))
    cells = [tuple(cell.strip().split(":", 1)) for cell in wanted.split(",") if cell.strip()]
    unknown = [cell for cell in cells if cell not in all_cells()]
    assert not unknown, f"no such cells: {unknown}; a cell is FAULT:OPERATION of {all_cells()}"
    return cells  # type: ignore[return-value]


@dataclass
class Answer:
    started: float
    ended: float
    status: int | None  # None: no answer at all (a dropped connection or the client's timeout)
    error: str = ""  # empty when it was answered 200
    clean: bool = True  # a failure with a status and an OpenAI error body
    hung: bool = False


class Traffic:
    """Clients asking "chat" through the gateway with the official openai client, no retries."""

    def __init__(self, url: str, key: str, clients: int = 2) -> None:
        import openai

        self.openai = openai
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT
        )
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _ask(self) -> Answer:
        openai = self.openai
        started = time.monotonic()
        try:
            self.client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else None
            clean = bool(body and isinstance(body.get("message"), str))
            # The client unwraps {"error": {...}}: body is the inner object with its message.
            return Answer(started, time.monotonic(), exc.status_code, f"{exc}"[:300], clean)
        except openai.APITimeoutError as exc:
            return Answer(started, time.monotonic(), None, f"timeout: {exc}", False, hung=True)
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            return Answer(
                started, time.monotonic(), None, f"{type(cause).__name__}: {cause}", False
            )
        return Answer(started, time.monotonic(), 200)

    def _run(self) -> None:
        while not self._stop.is_set():
            answer = self._ask()
            with self._lock:
                self.answers.append(answer)
            time.sleep(0.05)

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=CLIENT_TIMEOUT + 5)


@dataclass
class CellResult:
    fault: str
    operation: str
    seed: int
    outcome: str = "lost"  # completed / failed: REASON / lost
    sent: int = 0
    failed: int = 0  # every failed request
    excused: int = 0  # failures the fault may cause (see the module's docstring)
    recover_seconds: float | None = None
    double_placements: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    audit_missing: str = ""
    schedule: str = ""  # why the schedule did not send again, after a fault that stops it
    unexcused: list[str] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)  # of the failed requests
    fault_note: str = ""

    @property
    def ok(self) -> bool:
        return (self.outcome == "completed" or self.outcome.startswith("failed")) and not (
            self.double_placements
            or self.orphans
            or self.audit_missing
            or self.unexcused
            or self.schedule
        )

    def describe(self) -> str:
        return (
            f"{self.fault} x {self.operation} (seed {self.seed}): {self.outcome}; "
            f"{self.sent} requests, {self.failed} failed {self.statuses or ''} "
            f"({self.excused} excused); "
            f"recovered in {self.recover_seconds}s; {self.fault_note}; "
            f"double placements {self.double_placements}; orphan engines {self.orphans}; "
            f"audit: {self.audit_missing or 'ok'}; schedule: {self.schedule or 'ok'}; "
            f"unexcused failures {self.unexcused[:5]}"
        )


def _tree(pid: int) -> list[psutil.Process]:
    """A process and everything under it, children first."""
    try:
        top = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    return [*top.children(recursive=True), top]


def _kill_tree(pid: int) -> list[int]:
    processes = _tree(pid)
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(processes, timeout=10)
    return [p.pid for p in processes]


class Fleet:
    """The product as real processes on a PostgreSQL and a Redis of its own, with two nodes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.stack = contextlib.ExitStack()
        self.system: System | None = None
        self.node_tokens: dict[str, str] = {}
        self.agent_numbers: dict[str, int] = {}  # System.start_agent's count: the port range
        self.key = ""
        self.weights = ""

    def __enter__(self) -> Fleet:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def _start(self) -> None:
        weights_folder = self.folder / "weights"
        weights_folder.mkdir(parents=True, exist_ok=True)
        write_tiny_model(weights_folder / "tiny.gguf", seed=1)
        self.weights, _stats = self.stack.enter_context(serve_directory(weights_folder))
        self.database = postgres.PostgresServer()
        self.stack.callback(self.database.close)
        self.database.start()
        self.redis = RedisServer(self.folder / "redis")
        self.stack.callback(self.redis.stop)
        self.redis.start()
        # System makes its database where DATABASE_URL points (on this fleet's own server).
        saved = os.environ.get("DATABASE_URL")
        os.environ["DATABASE_URL"] = self.database.admin_url
        try:
            system = System(self.folder / "system", allowed_hosts=[urlsplit(self.weights).netloc])
        finally:
            if saved is None:
                os.environ.pop("DATABASE_URL")
            else:
                os.environ["DATABASE_URL"] = saved
        self.system = system
        self.stack.callback(system.close)
        system.env["REDIS_URL"] = self.redis.url
        # The processes run this tree's code, whatever is installed in the environment.
        system.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), system.env.get("PYTHONPATH", "")) if p
        )
        system.start()
        for name in NODES:
            self.node_tokens[name] = system.add_node(name, memory_gb=2, cores=2)
            self.agent_numbers[name] = system.agents_started
        wait_for(
            lambda: all(n["state"] == "ready" for n in system.api("GET", "nodes")),
            what="every agent's first heartbeat",
        )
        self._add("chat", min_replicas=1)
        self.wait_settled({"chat": 1})
        self.key = system.api("POST", "keys", json={"name": "faults"})["key"]

    def close(self) -> None:
        self.stack.close()

    # -- the fleet's state ------------------------------------------------------------

    @property
    def sys(self) -> System:
        assert self.system is not None
        return self.system

    def _add(self, name: str, **fields: Any) -> None:
        self.sys.api(
            "POST",
            "models",
            json={
                "name": name,
                "source": f"{self.weights}/tiny.gguf",
                "profiles": PROFILE,
                "context_length": 256,
                **fields,
            },
        )

    def replicas(self, model: str) -> list[dict[str, Any]]:
        return self.sys.api("GET", f"models/{model}/target")["replicas"]

    def model_names(self) -> set[str]:
        return {m["name"] for m in self.sys.api("GET", "models")}

    def settled(self, wanted: dict[str, int]) -> bool:
        """Each model has exactly its count placed and ready, and nothing else runs."""
        try:
            return self._settled(wanted)
        except AssertionError:  # the API answered an error: a process is not back yet
            return False

    def _settled(self, wanted: dict[str, int]) -> bool:
        for model, count in wanted.items():
            replicas = self.replicas(model)
            ready = [r for r in replicas if r["routable"]]
            placed = [r for r in replicas if r["state"] != "withdrawn"]
            if len(ready) != count or len(placed) != count:
                return False
        return not self.orphan_engines()

    def wait_settled(self, wanted: dict[str, int], timeout: float = OPERATION_TIMEOUT) -> None:
        wait_for(lambda: self.settled(wanted), timeout=timeout, interval=0.5, what=f"{wanted}")

    def engine_processes(self) -> dict[int, str]:
        """llama-server processes started under this fleet's folder: pid -> command line."""
        folder = str(self.sys.folder)
        found = {}
        for process in psutil.process_iter(["pid", "name", "cmdline"]):
            cmdline = " ".join(process.info["cmdline"] or [])
            if "llama-server" in (process.info["name"] or "") + cmdline and folder in cmdline:
                found[process.info["pid"]] = cmdline
        return found

    def owned_engine_pids(self) -> set[int]:
        """Pids the agents recorded for replicas the control plane knows of."""
        known = {r["id"]: r["node"] for m in self.model_names() for r in self.replicas(m)}
        pids = set()
        for state in (self.sys.folder / "nodes").glob("*/replicas/*/state.json"):
            if state.parent.name not in known:
                continue
            with contextlib.suppress(OSError, ValueError, KeyError):
                pids.add(int(json.loads(state.read_text())["pid"]))
        return pids

    def orphan_engines(self) -> list[str]:
        owned = self.owned_engine_pids()
        return [f"{pid}: {cmd[:160]}" for pid, cmd in self.engine_processes().items()
                if pid not in owned]  # fmt: skip

    def double_placements(self, wanted: dict[str, int]) -> list[str]:
        found = []
        for model, count in wanted.items():
            placed = [r for r in self.replicas(model) if r["state"] != "withdrawn"]
            if len(placed) > count:
                found.append(f"{model}: {len(placed)} placed for {count} asked")
            slots = [(r["node"], r["port"]) for r in placed if r.get("port")]
            if len(slots) != len(set(slots)):
                found.append(f"{model}: two replicas on one node and port: {slots}")
        return found

    def reset(self) -> None:
        """Back to one ready replica of "chat" and nothing else, between cells."""
        for name in self.model_names() - {"chat"}:
            self.sys.api("DELETE", f"models/{name}")
        self.sys.api("POST", "models/chat/scale", json={"min": 1})
        self.wait_settled({"chat": 1})

    # -- faults -----------------------------------------------------------------------

    def beat_pid(self) -> int:
        """The beat process, once it holds the lease: its log line "beat: HOST:PID:… runs the
        schedule now" names it."""
        pid = self.sys.processes["beat"].pid
        text = self.sys.logs["beat"].read_text(errors="replace")
        assert re.search(rf"beat: [^\s:]+:{pid}:\w+ runs the schedule now", text), (
            f"beat {pid} has not taken the schedule: {text[-500:]}"
        )
        return pid

    def schedule_sends_since(self, offset: int) -> bool:
        """Whether beat sent a periodic task after `offset` bytes of its log."""
        with self.sys.logs["beat"].open("rb") as log:
            log.seek(offset)
            return b"Sending due task" in log.read()

    def gateway_workers(self) -> list[psutil.Process]:
        """uvicorn's worker processes (not multiprocessing's resource tracker beside them)."""
        workers = []
        for child in psutil.Process(self.sys.processes["gateway"].pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if "spawn_main" in " ".join(child.cmdline()) and child.status() != "zombie":
                    workers.append(child)
        return workers

    def inject(self, fault: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
        """Kill or stop the part; returns a note and what restore() needs."""
        system = self.sys
        if fault == "web":
            process = system.processes.pop("web")
            killed = _kill_tree(process.pid)
            process.wait(timeout=10)
            return f"killed web pids {killed}", {"argv": [str(a) for a in process.args]}  # type: ignore[union-attr]
        if fault == "gateway-worker":
            workers = self.gateway_workers()
            victim = rng.choice(sorted(workers, key=lambda p: p.pid))
            victim.send_signal(signal.SIGKILL)
            return f"killed gateway worker {victim.pid} of {len(workers)}", {}
        if fault == "worker":
            process = system.processes.pop("worker")
            killed = _kill_tree(process.pid)
            process.wait(timeout=10)
            return f"killed worker and beat pids {killed}", {}
        if fault == "beat":
            pid = self.beat_pid()
            process = system.processes.pop("beat")
            os.kill(pid, signal.SIGKILL)
            process.wait(timeout=10)
            return f"killed beat {pid}", {}
        if fault == "node":
            name = rng.choice(NODES)
            process = system.processes.pop(f"node-{name}")
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
            return f"killed agent of {name} ({process.pid})", {"node": name}
        if fault == "engine":
            ready = [r for r in self.replicas("chat") if r["routable"]]
            replica = rng.choice(ready)
            state = system.folder / "nodes" / replica["node"] / "replicas" / replica["id"]
            pid = int(json.loads((state / "state.json").read_text())["pid"])
            os.kill(pid, signal.SIGKILL)
            return f"killed engine {pid} of replica {replica['id'][:8]} on {replica['node']}", {}
        if fault == "postgres":
            self.database.stop()
            return "stopped PostgreSQL", {}
        if fault == "redis":
            self.redis.stop()
            return "stopped Redis", {}
        raise ValueError(fault)

    def restore(self, fault: str, saved: dict[str, Any]) -> None:
        system = self.sys
        if fault == "web":
            system._spawn("web", saved["argv"])
        elif fault == "gateway-worker":
            # uvicorn's supervisor starts a worker in its place.
            wait_for(
                lambda: len(self.gateway_workers()) == 2,
                timeout=30,
                what="uvicorn to replace its worker",
            )
        elif fault == "worker":
            system.start_worker()
        elif fault == "beat":
            system.start_beat()
        elif fault == "node":
            # The same command line, as systemd would run it again: its port range too (System
            # gives each agent it starts new ports; a node that moved its range would have its
            # adopted engines refused, outside the ports it declares).
            name, started = saved["node"], system.agents_started
            system.agents_started = self.agent_numbers[name] - 1
            try:
                system.start_agent(name, self.node_tokens[name], memory_gb=2, cores=2)
            finally:
                system.agents_started = started
        elif fault == "postgres":
            self.database.start()
        elif fault == "redis":
            self.redis.start()


# -- operations -------------------------------------------------------------------------


def start_operation(fleet: Fleet, operation: str) -> dict[str, int]:
    """Ask for the operation; returns the replica counts it should end with."""
    if operation == "scale":
        fleet.sys.api("POST", "models/chat/scale", json={"min": 3})
        return {"chat": 3}
    if operation == "add":
        fleet._add("extra", min_replicas=1)
        return {"chat": 1, "extra": 1}
    raise ValueError(operation)


AUDIT = {"scale": ("chat", "scale"), "add": ("extra", "add")}


def failure_reason(fleet: Fleet, wanted: dict[str, int]) -> str:
    """What the control plane recorded about why the operation has not completed, if anything."""
    reasons = []
    for model in wanted:
        target = fleet.sys.api("GET", f"models/{model}/target")
        for replica in target["replicas"]:
            if replica["state"] == "failed" and replica.get("message"):
                reasons.append(f"{model}: {replica['message']}")
        for unplaced in target.get("unplaced") or []:
            reasons.append(f"{model}: unplaced {unplaced}")
    return "; ".join(reasons)


def _audit_missing(fleet: Fleet, operation: str) -> str:
    model, action = AUDIT[operation]
    with contextlib.suppress(requests.RequestException):
        entries = fleet.sys.api("GET", "audit", params={"model": model})["entries"]
        if any(e["action"] == action for e in entries):
            return ""
        return f"no {action!r} entry for {model}: {[e['action'] for e in entries[:5]]}"
    return "the audit could not be read"


def _excuse(fault: str, answer: Answer, fault_at: float, settled_at: float) -> bool:
    """Whether the fault may have failed this request (see the module's docstring)."""
    if answer.hung:
        return False
    if fault == "gateway-worker":
        # In flight on the killed worker: sent before the kill, no answer.
        return answer.status is None and answer.started <= fault_at + 0.2
    if fault == "engine":
        # In flight on the dead engine, or sent while it was the only one routed and before
        # its replacement was ready (the gateway sends a refused request to another ready
        # replica when there is one, gateway.proxy): an answer, cleanly.
        return (
            answer.clean
            and answer.status is not None
            and fault_at - 0.2 <= answer.ended
            and answer.started <= settled_at
        )
    return False


def _read(read: Any) -> Any:
    """`read()`, asked again for up to 20 s while the API answers an error (a part coming back)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return read()
        except (AssertionError, requests.RequestException):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run_cell(fleet: Fleet, fault: str, operation: str, seed: int) -> CellResult:
    rng = random.Random(f"{seed}:{fault}:{operation}")
    result = CellResult(fault, operation, seed)
    with Traffic(fleet.sys.url, fleet.key) as traffic:
        time.sleep(1.0)
        wanted = start_operation(fleet, operation)
        time.sleep(rng.uniform(0, LATEST_FAULT_SECONDS))
        fault_at = time.monotonic()
        result.fault_note, saved = fleet.inject(fault, rng)
        time.sleep(DOWN_SECONDS.get(fault, DEFAULT_DOWN_SECONDS))
        fleet.restore(fault, saved)
        log_offset = fleet.sys.logs["beat"].stat().st_size
        settled_at = float("inf")
        try:
            fleet.wait_settled(wanted)
            settled_at = time.monotonic()
            result.outcome = "completed"
            result.recover_seconds = round(settled_at - fault_at, 1)
        except AssertionError:
            reason = failure_reason(fleet, wanted)
            result.outcome = f"failed: {reason}" if reason else "lost"
        # A little traffic after it settled: the gateway must serve it all.
        time.sleep(1.0)
    if fault in ("worker", "beat", "postgres", "redis"):
        try:
            wait_for(
                lambda: fleet.schedule_sends_since(log_offset),
                timeout=SCHEDULE_BACK_SECONDS,
                what="a periodic task sent",
            )
        except AssertionError:
            result.schedule = f"no periodic task sent in {SCHEDULE_BACK_SECONDS:.0f}s after"
    result.double_placements = _read(lambda: fleet.double_placements(wanted))
    result.orphans = _read(fleet.orphan_engines)
    result.audit_missing = _audit_missing(fleet, operation)
    result.sent = len(traffic.answers)
    failures = [a for a in traffic.answers if a.status != 200]
    result.failed = len(failures)
    unexcused = [a for a in failures if not _excuse(fault, a, fault_at, settled_at)]
    result.excused = result.failed - len(unexcused)
    result.statuses = dict(Counter(str(a.status or "no answer") for a in failures))
    result.unexcused = [f"t{a.started - fault_at:+.1f}s {a.status} {a.error}" for a in unexcused]
    return result


@contextlib.contextmanager
def fleet_in(folder: Path) -> Iterator[Fleet]:
    with Fleet(folder) as fleet:
        try:
            yield fleet
        except BaseException:
            print(fleet.sys.log_tail() if fleet.system else "")
            raise
