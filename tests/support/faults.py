"""A fault matrix over a whole llmgw: one fault at a random moment of one operation, traffic through
the gateway the whole time, then the invariants that must hold once the faulty part is back.

`Fleet` runs the product as real processes (tests.support.system) on a PostgreSQL server and a
redis-server of its own (never the machine's), with two node agents running llama.cpp replicas of
a model "chat" that the traffic asks all along, and a registry of its own (olah over a git-lfs
repository, tests.support.registry) that a second model, "reg", is served from.
`run_cell(fleet, fault, operation, rng)` starts the operation, injects the fault at a moment drawn
from `rng` in the phase of the operation it aims at, restarts what was killed the way an operator
(or systemd) would, starts again any of web, worker and beat that exited on its own meanwhile, as
the run command does (`Fleet.tend`; the cell's `restarted` says which), and checks:

- the operation completes, or ends recorded as failed with a reason (else it is "lost");
- no replica is placed twice: no more placed replicas than asked for, no two on one node and port;
- no engine (llama-server) under the fleet's folder is left running that no replica owns;
- the audit records the operation (entries written after it was asked for: how it started, and
  for an update or a canary how it ended);
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
- engine: the llama-server of one ready replica (SIGKILL): of "chat", or during an update of
  "reg" one of "reg" on the new weights when there is one (a replaced replica, the canary), else
  one on the old; the agent and the reconciler replace it, nothing is restarted by hand.
- postgres: the fleet's PostgreSQL stopped (fast shutdown) and started again.
- redis: the fleet's redis-server stopped (an empty one comes back, as after a restart without
  persistence).
- worker+postgres: two faults at once: the Celery worker killed (as worker) and PostgreSQL
  stopped (as postgres); the worker is started again after 2 s while PostgreSQL is still down,
  PostgreSQL 3 s later.
- postgres-failover: a streaming standby of the fleet's PostgreSQL (pg_basebackup) runs from
  before the operation; the fault stops the server for good and promotes the standby on its
  port (a new timeline, the old data gone), as a replicated PostgreSQL fails over.
- clock-plane-ahead, clock-plane-behind: the wall clock of every control-plane process
  (gateway, web, worker, beat) stepped 5 minutes forward or back, as NTP steps a machine's
  clock; clock-node-ahead, clock-node-behind: one node's (its agent and its engines). The
  monotonic clock runs on. The clock stays where the step put it (later cells run with it).
  tests.support.stepclock does it (a library in LD_PRELOAD that adds the offset in a file per
  clock, which the fault rewrites): never the machine's clock. PostgreSQL's and Redis's clocks
  are not stepped.
- beat-in-worker, worker-with-beat: beat run inside the worker (`celery worker -B`, as some
  operators run it) from before the operation; the fault kills the beat process inside the
  worker (the worker must stop, for its supervisor to start it again with a new beat:
  llmgw_site.celery.WatchEmbeddedBeat), or the whole worker, started again with -B. After the
  cell the fleet goes back to beat as a process of its own.

After the new faults (NEW_FAULTS: worker+postgres and those after it) two more things must not
happen: a node declared lost (the agents never stop in them), and a lease held by two (a fetch
taken over from a worker still running it, or a beat that loses the lease to another while it
runs). In the clock
cells the clients use a key that expires 9 minutes after the cell began by the gateway's clock:
a step of 5 minutes must not expire it. After postgres, worker+postgres and postgres-failover the
gateway must see a change made afterwards within LISTEN_SECONDS (a new key answered, then
refused once revoked), so its LISTEN connection and its pools are on the server as it is now.

The operations (`OPERATIONS`, each an `Operation`):
- scale: "chat" from one replica to three.
- add: a model "extra" added by URL, one replica.
- serve: `model serve` of the registry's repository as "reg" (two replicas): its file fetched
  into the mirror, the model added, its replicas placed; the fault lands within 5 s, in the
  fetch or the placement.
- update-fetch: "reg" served, new weights pushed to the registry and seen by the update check,
  then `model update reg`; the fault lands within 2.4 s, while the new files are fetched.
- update-roll: the same update; the fault lands once the API shows the rollout rolling, within
  3 s, while the replicas are replaced one at a time.
- canary: the same update with `--canary 50 --for 10s`; the fault lands in the window (once the
  API shows the canary watching). It ends promoted (then completed as an update) or rolled back.
An update ends completed when its rollout is done and every replica runs the new weights, or
failed with the rollout's message (failed, halted) or the canary's decision (rolled back), its
replicas on the old weights. The clients ask "chat" and "reg" in turn while "reg" is updated.
The registry sits behind a proxy that hands its files out slowly (tests.support.slow_proxy): the
tiny file's fetch into the mirror lasts FETCH_SECONDS (3 s), so that a fault can land in it. Each
cell records where the operation was when the fault landed, as the API showed it
(`CellResult.phase`).

The seed: LLMGW_FAULT_SEED replays a run (the tests and bench/faults.py print it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import requests

from llmgw.tinygguf import write_tiny_model
from tests.support import postgres, stepclock, waiting
from tests.support.http_files import serve_directory
from tests.support.redis_server import RedisServer
from tests.support.registry import LocalRegistry
from tests.support.registry import available as registry_unavailable
from tests.support.slow_proxy import slow_proxy
from tests.support.system import ROOT, System, wait_for

FAULTS = (
    "web",
    "gateway-worker",
    "worker",
    "beat",
    "node",
    "engine",
    "postgres",
    "redis",
    "worker+postgres",
    "postgres-failover",
    "clock-plane-ahead",
    "clock-plane-behind",
    "clock-node-ahead",
    "clock-node-behind",
    "beat-in-worker",
    "worker-with-beat",
)
# The faults added in issue 44, checked for nodes declared lost and leases held by two as well.
NEW_FAULTS = FAULTS[FAULTS.index("worker+postgres") :]
# After these, beat must send a periodic task again within SCHEDULE_BACK_SECONDS.
SCHEDULE_FAULTS = ("worker", "beat", "postgres", "redis", *NEW_FAULTS)
# After these, the gateway must follow a change made afterwards within LISTEN_SECONDS.
DATABASE_FAULTS = ("postgres", "worker+postgres", "postgres-failover")
LISTEN_SECONDS = 10.0
# The clock faults: which clock ("plane", or a node's) and which way it steps, by CLOCK_STEP.
CLOCK_FAULTS = {
    "clock-plane-ahead": ("plane", 1),
    "clock-plane-behind": ("plane", -1),
    "clock-node-ahead": ("node", 1),
    "clock-node-behind": ("node", -1),
}
CLOCK_STEP = 300
# The key the clients use in a clock cell expires this long after the cell began, by the
# gateway's clock: more than a step.
CLOCK_KEY_SECONDS = 9 * 60
# After a clock cell's operation, a change asked then must be carried out within this long.
AFTER_STEP_SECONDS = 60.0
BEAT_IN_WORKER_FAULTS = ("beat-in-worker", "worker-with-beat")
# Cells ("fault:operation", or a fault for all its cells) that fail for a cause in the product
# not yet fixed, and why: the suite's draw leaves them out (bench/faults.py runs them, and so
# does naming a cell in LLMGW_FAULT_CELLS). Remove one once its cause is fixed.
KNOWN_FAILING: dict[str, str] = {}


def known_failing(cell: tuple[str, str]) -> bool:
    return cell[0] in KNOWN_FAILING or f"{cell[0]}:{cell[1]}" in KNOWN_FAILING


# After a fault that stops the schedule, a periodic task is sent again within this long
# (the beat lease, 15 s, plus the 1 s reconcile interval and some slack).
SCHEDULE_BACK_SECONDS = 25.0
# scale and add change "chat" and a model added by URL; the others a model served from the
# fleet's own registry ("reg", REPO): see `Operation`.
OPERATIONS = ("scale", "add", "serve", "update-fetch", "update-roll", "canary")
REGISTRY_OPERATIONS = ("serve", "update-fetch", "update-roll", "canary")
PROFILE = [{"name": "cpu", "memory_gb": 1, "cores": 1}]
NODES = ("node-a", "node-b")
# The served model: its repository in the fleet's registry, its file, and its replicas (small,
# so that a surge replica fits beside them and "chat" at three).
REPO = "acme/fault-GGUF"
REPO_FILE = "fault-q4.gguf"
SERVED = "reg"
SERVED_REPLICAS = 2
SERVED_SIZE = {"memory_gb": 0.5, "cores": 0.5}
# How long fetching the served model's file from the registry takes (its proxy's pace).
FETCH_SECONDS = 3.0
# The weights the registry holds in turn (seeds of write_tiny_model): each update pushes the
# next one, never the same as the head.
WEIGHT_SEEDS = (11, 12, 13)
# A canary: this share of the served model's requests to the new revision, for this window,
# decided after this many answers from it (the fleet's LLMGW_CANARY_MIN_REQUESTS), checked this
# often (LLMGW_CANARY_CHECK_SECONDS). The latency ratio is wide: the replicas share two cores
# with everything else, and the canary is about the fault, not a slow revision.
CANARY = {"canary": 50, "for": "10s", "max_latency_ratio": 20}
CANARY_WINDOW_SECONDS = 10.0
CANARY_MIN_REQUESTS = 8
CANARY_CHECK_SECONDS = 2
# How long a killed process stays down before it is started again, and a stopped server.
DOWN_SECONDS = {
    "postgres": 5.0,
    "redis": 3.0,
    # The worker comes back after 2 s (restore), PostgreSQL after WORKER_POSTGRES_SECONDS more.
    "worker+postgres": 2.0,
    # A fail-over is its own outage (stop, start, promote); a step of the clock is at once; the
    # worker whose beat died stops itself, and tend() starts it again.
    "postgres-failover": 0.0,
    "clock-plane-ahead": 0.0,
    "clock-plane-behind": 0.0,
    "clock-node-ahead": 0.0,
    "clock-node-behind": 0.0,
    "beat-in-worker": 0.0,
}
WORKER_POSTGRES_SECONDS = 3.0
DEFAULT_DOWN_SECONDS = 2.0
# What tend() starts again when it exits on its own, and after how long (llmgw_run's
# RESTART_DELAY, the first restart's delay).
SUPERVISED = ("web", "worker", "beat")
RESTART_DELAY = 1.0
# The fault lands this long at most after the operation was asked for.
LATEST_FAULT_SECONDS = 3.0
OPERATION_TIMEOUT = 150.0
CLIENT_TIMEOUT = 30.0
TRAFFIC_CLIENTS = 2
# Requests sent (and answered) after the operation ended, before the cell is judged: each client
# three, the models in turn.
SETTLED_ANSWERS = 3 * TRAFFIC_CLIENTS


def unavailable(fault: str) -> str | None:
    """Why `fault` cannot be tried on this machine; None when it can."""
    if fault in CLOCK_FAULTS and stepclock.unavailable() is not None:
        return stepclock.unavailable()
    if fault == "postgres-failover" and not (
        postgres.BIN is not None and (postgres.BIN / "pg_basebackup").exists()
    ):
        return "a fail-over needs PostgreSQL's pg_basebackup"
    return None


def seed_from_environment() -> int:
    """LLMGW_FAULT_SEED when set (to replay a run), else a new one."""
    given = os.environ.get("LLMGW_FAULT_SEED", "").strip()
    return int(given) if given else random.SystemRandom().randrange(1, 10**6)


def all_cells() -> list[tuple[str, str]]:
    return [(fault, operation) for fault in FAULTS for operation in OPERATIONS]


def sample_cells(rng: random.Random, wanted: str) -> list[tuple[str, str]]:
    """`wanted` is a number of cells drawn by `rng` (none of KNOWN_FAILING's), or named cells:
    "web:add,engine:scale"."""
    if wanted.strip().isdigit():
        drawn = [cell for cell in all_cells() if not known_failing(cell)]
        return rng.sample(drawn, int(wanted))
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
    model: str = "chat"


class Traffic:
    """Clients asking `models` in turn ("chat", and the served model while an operation changes
    it) through the gateway with the official openai client, no retries."""

    def __init__(
        self,
        url: str,
        key: str,
        clients: int = TRAFFIC_CLIENTS,
        models: tuple[str, ...] = ("chat",),
    ) -> None:
        import openai

        self.openai = openai
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT
        )
        self.models = models
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(number,), daemon=True)
            for number in range(clients)
        ]

    def _ask(self, model: str) -> Answer:
        openai = self.openai
        started = time.monotonic()
        try:
            self.client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else None
            clean = bool(body and isinstance(body.get("message"), str))
            # The client unwraps {"error": {...}}: body is the inner object with its message.
            return Answer(
                started, time.monotonic(), exc.status_code, f"{exc}"[:300], clean, model=model
            )
        except openai.APITimeoutError as exc:
            return Answer(
                started, time.monotonic(), None, f"timeout: {exc}", False, hung=True, model=model
            )
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            return Answer(
                started,
                time.monotonic(),
                None,
                f"{type(cause).__name__}: {cause}",
                False,
                model=model,
            )
        return Answer(started, time.monotonic(), 200, model=model)

    def _run(self, number: int) -> None:
        while not self._stop.is_set():
            answer = self._ask(self.models[number % len(self.models)])
            number += 1
            with self._lock:
                self.answers.append(answer)
            time.sleep(0.05)  # paces the load generator: a client's next request

    def answered_since(self, moment: float) -> int:
        """How many requests sent at `moment` (time.monotonic()) or later have had their answer
        (or failure)."""
        with self._lock:
            return sum(1 for answer in self.answers if answer.started >= moment)

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
    phase: str = ""  # where the operation was when the fault landed, as the API showed it
    ending: str = ""  # how it ended, as the API recorded it (a rollout's message, a canary's)
    restarted: list[str] = field(default_factory=list)  # parts that exited on their own (tend)
    nodes_lost: list[str] = field(default_factory=list)  # declared lost during the cell
    held_by_two: list[str] = field(default_factory=list)  # a lease taken from a live holder
    gateway: str = ""  # why the gateway did not follow a change made after a database fault
    after_step: str = ""  # why a change asked after a clock step was not carried out

    @property
    def ok(self) -> bool:
        return (self.outcome == "completed" or self.outcome.startswith("failed")) and not (
            self.double_placements
            or self.orphans
            or self.audit_missing
            or self.unexcused
            or self.schedule
            or self.nodes_lost
            or self.held_by_two
            or self.gateway
            or self.after_step
        )

    def describe(self) -> str:
        return (
            f"{self.fault} x {self.operation} (seed {self.seed}): {self.outcome}; "
            f"fault during: {self.phase or '-'}; ended: {self.ending or '-'}; "
            f"{self.sent} requests, {self.failed} failed {self.statuses or ''} "
            f"({self.excused} excused); "
            f"recovered in {self.recover_seconds}s; {self.fault_note}; "
            f"started again: {', '.join(self.restarted) or 'none'}; "
            f"double placements {self.double_placements}; orphan engines {self.orphans}; "
            f"audit: {self.audit_missing or 'ok'}; schedule: {self.schedule or 'ok'}; "
            f"nodes lost {self.nodes_lost}; leases held by two {self.held_by_two}; "
            f"gateway: {self.gateway or 'ok'}; after the step: {self.after_step or 'ok'}; "
            f"unexcused failures {self.unexcused[:5]}"
        )


def _read_from(path: Path, offset: int) -> bytes:
    with path.open("rb") as log:
        log.seek(offset)
        return log.read()


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
        self.key = ""
        self.weights = ""
        self.registry: LocalRegistry | None = None
        self.head_seed = WEIGHT_SEEDS[0]  # the weights at the head of REPO
        self.serve_fetches: list[int] = []  # the fetches `model serve` started
        self.restarted: list[str] = []  # what tend() started again, and why
        # Each clock's offset from the real time, in seconds: "plane" (every control-plane
        # process) and each node's (its agent and engines). Empty without a steppable clock.
        self.clocks: dict[str, int] = {}
        self.stepclock: Path | None = None  # the library that steps them (tests.support.stepclock)
        self.beat_in_worker = False  # beat runs inside the worker (-B), not beside it

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
        for seed in WEIGHT_SEEDS:
            write_tiny_model(self.weights_file(seed), seed=seed)
        self.weights, _stats = self.stack.enter_context(serve_directory(weights_folder))
        # The registry the served model comes from: olah over a git-lfs repository of REPO
        # (none where git-lfs or olah is missing: then only scale and add can run).
        config: dict[str, Any] = {}
        if registry_unavailable() is None:
            self.registry = LocalRegistry(self.folder / "registry")
            self.registry.commit(REPO, {REPO_FILE: self.weights_file(self.head_seed)})
            self.stack.callback(self.registry.stop)
            self.registry.start()
            # Behind a proxy that hands out its files slowly: a fetch into the mirror then
            # lasts FETCH_SECONDS, long enough for a fault to land in it.
            rate = self.weights_file(self.head_seed).stat().st_size / FETCH_SECONDS
            endpoint = self.stack.enter_context(
                slow_proxy(self.registry.endpoint, bytes_per_second=rate)
            )
            config["registry"] = {"endpoint": endpoint}
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
            system = System(
                self.folder / "system",
                config=config,
                allowed_hosts=[urlsplit(self.weights).netloc],
            )
        finally:
            if saved is None:
                os.environ.pop("DATABASE_URL")
            else:
                os.environ["DATABASE_URL"] = saved
        self.system = system
        self.stack.callback(system.close)
        if stepclock.unavailable() is None:
            self.stepclock = stepclock.build(self.folder / "clocks")
        system.env.update(self._clock_env("plane"))
        system.env["REDIS_URL"] = self.redis.url
        system.env["LLMGW_CANARY_CHECK_SECONDS"] = str(CANARY_CHECK_SECONDS)
        system.env["LLMGW_CANARY_MIN_REQUESTS"] = str(CANARY_MIN_REQUESTS)
        # The processes run this tree's code, whatever is installed in the environment.
        system.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), system.env.get("PYTHONPATH", "")) if p
        )
        system.start()
        for name in NODES:
            self.node_tokens[name] = system.add_node(name, memory_gb=2, cores=2, start=False)
            self._start_agent(name)
        wait_for(
            lambda: all(n["state"] == "ready" for n in system.api("GET", "nodes")),
            what="every agent's first heartbeat",
        )
        self._add("chat", min_replicas=1)
        self.wait_settled({"chat": 1})
        self.key = system.api("POST", "keys", json={"name": "faults"})["key"]

    def close(self) -> None:
        self.stack.close()

    def _start_agent(self, name: str, *, same_ports: bool = False) -> None:
        self.sys.start_agent(
            name,
            self.node_tokens[name],
            memory_gb=2,
            cores=2,
            env=self._clock_env(name),
            same_ports=same_ports,
        )

    # -- clocks -------------------------------------------------------------------------

    def _clock_file(self, clock: str) -> Path:
        return self.folder / "clocks" / f"{clock}.rc"

    def _clock_env(self, clock: str) -> dict[str, str]:
        """The environment that puts a process on `clock` (tests.support.stepclock; nothing
        where it cannot be built): the real time plus the clock's offset, read again at most
        once a second; the monotonic clock left alone, as a step of the wall clock leaves it."""
        if self.stepclock is None:
            return {}
        if clock not in self.clocks:
            self._set_clock(clock, 0)
        return stepclock.environment(self.stepclock, self._clock_file(clock))

    def _set_clock(self, clock: str, offset: int) -> None:
        """Step `clock` to `offset` seconds from the real time: its processes read the new
        offset within a second."""
        stepclock.set_offset(self._clock_file(clock), offset)
        self.clocks[clock] = offset

    # -- beat inside the worker, a standby ----------------------------------------------

    def arrange(self, fault: str) -> None:
        """Put in place what `fault` needs before its operation starts: beat inside the worker
        (-B), or a standby of the database to fail over to."""
        if fault in BEAT_IN_WORKER_FAULTS and not self.beat_in_worker:
            # SIGTERM: the beat releases its lease, and the worker's beat takes it at once.
            self.sys.stop_processes(["worker", "beat"])
            self.beat_in_worker = True
            self._start_worker()
            wait_for(
                self.embedded_beat_pid,
                timeout=60,
                what="the beat inside the worker to take the schedule",
            )
        if fault == "postgres-failover" and self.database.standby is None:
            self.database.start_standby()

    def _leave_beat_in_worker(self) -> None:
        """Back to beat as a process of its own beside a worker without -B."""
        self.sys.stop_processes(["worker"])
        self.beat_in_worker = False
        self.sys.start_worker()
        self.sys.start_beat()
        wait_for(
            lambda: self._holds(self.beat_pid),
            timeout=60,
            interval=0.5,
            what="beat to take the schedule again",
        )

    @staticmethod
    def _holds(pid_of: Any) -> bool:
        try:
            return bool(pid_of())
        except AssertionError:
            return False

    def _start_worker(self) -> None:
        if not self.beat_in_worker:
            self.sys.start_worker()
            return
        from llmgw_site.management.commands.llmgw_run import worker_command

        argv = [*worker_command(Path(sys.executable).parent), "-B", "--scheduler",
                "llmgw_site.beat:LeaderScheduler", "--schedule",
                str(self.sys.folder / "beat-schedule-in-worker")]  # fmt: skip
        self.sys._spawn("worker", argv)

    def embedded_beat_pid(self) -> int | None:
        """The beat inside the worker (-B), once it holds the lease: the pid it logs as it
        starts, and its line "beat: HOST:PID:… runs the schedule now"."""
        text = self.sys.logs["worker"].read_text(errors="replace")
        started = re.findall(r"beat: running inside the worker as process (\d+)", text)
        if not started:
            return None
        pid = int(started[-1])
        if not re.search(rf"beat: [^\s:]+:{pid}:\w+ runs the schedule now", text):
            return None
        # The last one logged may be of a worker killed since, whose new one has not logged yet.
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None
        return pid if state != "Z" else None

    def schedule_log(self) -> Path:
        """The log beat writes to: its own, or the worker's when it runs inside it."""
        return self.sys.logs["worker" if self.beat_in_worker else "beat"]

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
        def tended_and_settled() -> bool:
            self.tend()
            return self.settled(wanted)

        wait_for(tended_and_settled, timeout=timeout, interval=0.5, what=f"{wanted}")

    def tend(self) -> None:
        """Start again any of web, worker and beat that exited on its own, RESTART_DELAY after
        it was seen gone, as the run command's supervisor does (systemd's Restart=on-failure
        too). A part that a fault killed is not here (inject takes it out of the system's
        processes until restore starts it). What was started again is added to `restarted`.

        Why: a part may exit because of another part's fault. A Celery 5.7.0 worker that lost
        Redis while holding messages not yet acknowledged (a task due later, or prefetched)
        exited with code 1 as it closed the connection (pyproject.toml keeps Celery below 5.7);
        the run command starts such a part again, and so does this."""
        for name in SUPERVISED:
            process = self.sys.processes.get(name)
            if process is None or process.poll() is None:
                continue
            time.sleep(RESTART_DELAY)  # time is what is imitated: the run command's delay
            self._start_again(name, [str(a) for a in process.args])  # type: ignore[union-attr]
            self.restarted.append(f"{name} exited with code {process.returncode}")

    def _start_again(self, name: str, argv: list[str]) -> None:
        """Start web (with its command line `argv`), worker or beat again."""
        if name == "web":
            self.sys._spawn("web", argv)
        elif name == "worker":
            self._start_worker()
        else:
            self.sys.start_beat()

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
        """Back to one ready replica of "chat" and nothing else, between cells: no fetch of a
        `model serve` left to add its model later, the served model removed (with its
        rollout, its canary and its engines)."""

        if self.beat_in_worker:
            self._leave_beat_in_worker()

        def fetches_ended() -> bool:
            self.tend()
            return not any(
                self.fetch(pk)["state"] in ("queued", "running") for pk in self.serve_fetches
            )

        wait_for(
            fetches_ended,
            timeout=OPERATION_TIMEOUT,
            interval=0.5,
            what="the fetches of `model serve` to end",
        )
        for name in self.model_names() - {"chat"}:
            self.sys.api("DELETE", f"models/{name}")
        self.sys.api("POST", "models/chat/scale", json={"min": 1})
        self.wait_settled({"chat": 1})

    # -- the registry and the served model ----------------------------------------------

    def weights_file(self, seed: int) -> Path:
        return self.folder / "weights" / f"w{seed}.gguf"

    def weights_sha256(self, seed: int) -> str:
        return hashlib.sha256(self.weights_file(seed).read_bytes()).hexdigest()

    def fetch(self, pk: int) -> dict[str, Any]:
        return self.sys.api("GET", f"fetches/{pk}")

    def start_serve(self) -> int:
        """`model serve REPO` as the served model; the fetch's id."""
        fetch = self.sys.api(
            "POST",
            "serve",
            json={"repo": REPO, "name": SERVED, "min": SERVED_REPLICAS, **SERVED_SIZE},
        )
        self.serve_fetches.append(fetch["id"])
        return int(fetch["id"])

    def serve(self) -> None:
        """The served model on the registry's head, its replicas ready."""
        pk = self.start_serve()
        wait_for(
            lambda: self.fetch(pk)["model_added"],
            timeout=OPERATION_TIMEOUT,
            interval=0.5,
            what=f"fetch {pk} of {REPO} and {SERVED} added",
        )
        self.wait_settled({"chat": 1, SERVED: SERVED_REPLICAS})
        assert self.on_weights(self.head_seed), self.replicas(SERVED)

    def push_weights(self) -> int:
        """New weights at the head of REPO, seen by the update check; their seed."""
        assert self.registry is not None
        seed = WEIGHT_SEEDS[(WEIGHT_SEEDS.index(self.head_seed) + 1) % len(WEIGHT_SEEDS)]
        commit = self.registry.commit(
            REPO, {REPO_FILE: self.weights_file(seed)}, message=f"weights of seed {seed}"
        )
        self.head_seed = seed
        check = self.sys.api("POST", "updates/check")
        seen = {u["model"]: u["new_commit"] for u in check["updates"]}
        assert seen.get(SERVED) == commit, check
        return seed

    def on_weights(self, seed: int) -> bool:
        """Every placed replica of the served model runs these weights, and is ready."""
        placed = [r for r in self.replicas(SERVED) if r["state"] != "withdrawn"]
        digest = self.weights_sha256(seed)
        return len(placed) == SERVED_REPLICAS and all(
            r["routable"] and r["weights_sha256"] == digest for r in placed
        )

    def last_audit_id(self) -> int:
        entries = self.sys.api("GET", "audit", params={"limit": 1})["entries"]
        return int(entries[0]["id"]) if entries else 0

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
        return b"Sending due task" in _read_from(self.schedule_log(), offset)

    def nodes_lost_since(self, offset: int) -> list[str]:
        """The reconciler's lines declaring nodes lost after `offset` bytes of the worker's log."""
        text = _read_from(self.sys.logs["worker"], offset).decode(errors="replace")
        return re.findall(r"nodes lost \(no heartbeat for [^)]*\): .*", text)

    def held_by_two_since(self, worker_offset: int, beat_offset: int) -> list[str]:
        """Leases taken from a holder that was still running, after these offsets of the logs:
        a fetch taken over from a live worker (which logs it as it stops), a beat that learns
        at its renewal that another took its lease."""
        worker = _read_from(self.sys.logs["worker"], worker_offset).decode(errors="replace")
        beat = _read_from(self.schedule_log(), beat_offset).decode(errors="replace")
        return [
            *re.findall(r"fetch \d+ was taken over by another worker.*", worker),
            *re.findall(r"beat: \S+ lost the lease to .*", beat),
        ]

    def cell_key(self, name: str) -> tuple[str, str]:
        """A key for the clients that expires CLOCK_KEY_SECONDS from now by the gateway's clock
        (the control plane's, with its offset): the key and its expiry."""
        offset = self.clocks.get("plane", 0)
        expires = datetime.now(UTC) + timedelta(seconds=offset + CLOCK_KEY_SECONDS)
        made = self.sys.api("POST", "keys", json={"name": name, "expires": expires.isoformat()})
        return made["key"], made["expires_at"]

    def gateway_follows(self) -> str:
        """'' when the gateway follows a change made now: a new key answered (its pools reach
        the database), then refused within LISTEN_SECONDS of its revocation (a notification on
        its LISTEN connection: without one, its full check comes every 60 s); else what it did."""
        made = self.sys.api("POST", "keys", json={"name": f"follows-{time.monotonic_ns()}"})

        def status() -> int:
            return requests.get(
                f"{self.sys.url}/v1/models",
                headers={"Authorization": f"Bearer {made['key']}"},
                timeout=CLIENT_TIMEOUT,
            ).status_code

        try:
            wait_for(lambda: status() == 200, timeout=30, interval=0.2, what="a new key answered")
        except AssertionError:
            return f"a key made after the fault was not answered in 30 s ({status()})"
        self.sys.api("POST", f"keys/{made['id']}/revoke")
        try:
            wait_for(
                lambda: status() == 401,
                timeout=LISTEN_SECONDS,
                interval=0.2,
                what="the revoked key refused",
            )
        except AssertionError:
            return (
                f"a key revoked after the fault was still answered {LISTEN_SECONDS:.0f} s later "
                "(no notification reached the gateway)"
            )
        return ""

    def gateway_workers(self) -> list[psutil.Process]:
        """uvicorn's worker processes (not multiprocessing's resource tracker beside them)."""
        workers = []
        for child in psutil.Process(self.sys.processes["gateway"].pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if "spawn_main" in " ".join(child.cmdline()) and child.status() != "zombie":
                    workers.append(child)
        return workers

    def inject(
        self, fault: str, rng: random.Random, engines: list[dict[str, Any]] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Kill or stop the part; returns a note and what restore() needs. `engines`: the
        replicas whose engine the engine fault may kill (by default the ready ones of "chat")."""
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
            return f"killed worker pids {killed}", {}
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
            ready = engines or [r for r in self.replicas("chat") if r["routable"]]
            replica = rng.choice(sorted(ready, key=lambda r: r["id"]))
            state = system.folder / "nodes" / replica["node"] / "replicas" / replica["id"]
            pid = int(json.loads((state / "state.json").read_text())["pid"])
            os.kill(pid, signal.SIGKILL)
            return (
                f"killed engine {pid} of replica {replica['id'][:8]} of {replica.get('model', 'chat')} "
                f"on {replica['node']}",
                {},
            )
        if fault == "postgres":
            self.database.stop()
            return "stopped PostgreSQL", {}
        if fault == "redis":
            self.redis.stop()
            return "stopped Redis", {}
        if fault in ("worker+postgres", "worker-with-beat"):
            process = system.processes.pop("worker")
            killed = _kill_tree(process.pid)
            process.wait(timeout=10)
            if fault == "worker-with-beat":
                return f"killed the worker running beat (-B), pids {killed}", {}
            self.database.stop()
            return f"killed worker pids {killed} and stopped PostgreSQL", {}
        if fault == "postgres-failover":
            timeline = "SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)"
            before = self.database.query(timeline)
            self.database.fail_over()
            return (
                f"PostgreSQL failed over to its standby, promoted on its port: timeline {before} "
                f"-> {self.database.query(timeline)}",
                {},
            )
        if fault in CLOCK_FAULTS:
            which, sign = CLOCK_FAULTS[fault]
            clock = "plane" if which == "plane" else rng.choice(NODES)
            self._set_clock(clock, self.clocks[clock] + sign * CLOCK_STEP)
            return (
                f"stepped the clock of {clock} by {sign * CLOCK_STEP:+d} s "
                f"(now {self.clocks[clock]:+d} s from the real time)",
                {},
            )
        if fault == "beat-in-worker":
            # After a worker started again (a cell before), its beat may still be waiting for
            # the dead one's lease.
            embedded = wait_for(
                self.embedded_beat_pid,
                timeout=SCHEDULE_BACK_SECONDS * 2,
                what="a beat inside the worker that holds the schedule",
            )
            os.kill(embedded, signal.SIGKILL)
            return f"killed beat {embedded} inside worker {system.processes['worker'].pid}", {}
        raise ValueError(fault)

    def restore(self, fault: str, saved: dict[str, Any]) -> None:
        if fault in ("web", "worker", "beat"):
            self._start_again(fault, saved.get("argv", []))
        elif fault == "worker-with-beat":
            self._start_worker()
        elif fault == "worker+postgres":
            self._start_worker()  # while PostgreSQL is still down
            time.sleep(WORKER_POSTGRES_SECONDS)  # time is what is tested: the database stays down
            self.database.start()
        elif fault == "gateway-worker":
            # uvicorn's supervisor starts a worker in its place.
            wait_for(
                lambda: len(self.gateway_workers()) == 2,
                timeout=30,
                what="uvicorn to replace its worker",
            )
        elif fault == "node":
            # The same command line, as systemd would run it again: its port range too (System
            # gives each agent it starts new ports; a node that moved its range would have its
            # adopted engines refused, outside the ports it declares).
            self._start_agent(saved["node"], same_ports=True)
        elif fault == "postgres":
            self.database.start()
        elif fault == "redis":
            self.redis.start()


# -- operations -------------------------------------------------------------------------


class Operation:
    """One operation of the matrix: prepared before the traffic starts (`prepare`), asked for
    (`start`), the fault aimed at a phase of it (`aim` returns when the fault should land;
    `phase` says where the operation is, as the API shows it), and watched until it ends
    (`ended`). It ends completed, or failed with the reason the control plane recorded; one
    that does neither within OPERATION_TIMEOUT is lost (`failure` reads what was recorded)."""

    name = ""
    traffic: tuple[str, ...] = ("chat",)  # the models the clients ask in turn

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.wanted: dict[str, int] = {"chat": 1}  # the replica counts it ends with

    def prepare(self) -> None:
        pass

    def start(self) -> None:
        raise NotImplementedError

    def aim(self, rng: random.Random) -> None:
        time.sleep(rng.uniform(0, LATEST_FAULT_SECONDS))  # time is tested: the fault's moment

    def phase(self) -> str:
        return ""

    def engines(self) -> list[dict[str, Any]] | None:
        """The replicas whose engine the engine fault may kill (None: the ready ones of
        "chat")."""
        return None

    def ended(self) -> tuple[str, str] | None:
        """(outcome, how it ended) once it has; None while it is under way."""
        return ("completed", "") if self.fleet.settled(self.wanted) else None

    def failure(self) -> str:
        """After OPERATION_TIMEOUT: the outcome from what the control plane recorded."""
        reason = failure_reason(self.fleet, self.wanted)
        return f"failed: {reason}" if reason else "lost"

    def audit(self, outcome: str) -> list[tuple[str, tuple[str, ...]]]:
        """The audit entries it must leave: (model, any one of these actions) each."""
        raise NotImplementedError


class Scale(Operation):
    name = "scale"

    def start(self) -> None:
        self.fleet.sys.api("POST", "models/chat/scale", json={"min": 3})
        self.wanted = {"chat": 3}

    def audit(self, outcome: str) -> list[tuple[str, tuple[str, ...]]]:
        return [("chat", ("scale",))]


class Add(Operation):
    name = "add"

    def start(self) -> None:
        self.fleet._add("extra", min_replicas=1)
        self.wanted = {"chat": 1, "extra": 1}

    def audit(self, outcome: str) -> list[tuple[str, tuple[str, ...]]]:
        return [("extra", ("add",))]


class Serve(Operation):
    """`model serve REPO`: the file fetched into the mirror, the model added, its replicas
    placed. The fault lands in the fetch (FETCH_SECONDS) or in the placement after it."""

    name = "serve"

    def start(self) -> None:
        self.wanted = {"chat": 1, SERVED: SERVED_REPLICAS}
        self.fetch_id = self.fleet.start_serve()

    def aim(self, rng: random.Random) -> None:
        time.sleep(rng.uniform(0, FETCH_SECONDS + 2.0))  # time is tested: the fault's moment

    def phase(self) -> str:
        fetch = self.fleet.fetch(self.fetch_id)
        if fetch["state"] != "done":
            return f"fetch {fetch['state']} ({fetch['bytes_done']} of {fetch['bytes_total']} bytes)"
        if not fetch["model_added"]:
            return "fetched, the model not added yet"
        ready = sum(r["routable"] for r in self.fleet.replicas(SERVED))
        return f"placing: {ready} of {SERVED_REPLICAS} replicas ready"

    def ended(self) -> tuple[str, str] | None:
        fetch = self.fleet.fetch(self.fetch_id)
        if fetch["state"] == "failed":
            return f"failed: fetch {self.fetch_id}: {fetch['message']}", fetch["message"]
        if (
            fetch["model_added"]
            and self.fleet.settled(self.wanted)
            and self.fleet.on_weights(self.fleet.head_seed)
        ):
            return "completed", f"{SERVED} added, {SERVED_REPLICAS} replicas ready"
        return None

    def failure(self) -> str:
        fetch = self.fleet.fetch(self.fetch_id)
        if not fetch["model_added"]:
            return f"lost: fetch {fetch['state']} {fetch['message']!r}, model not added"
        return super().failure()

    def audit(self, outcome: str) -> list[tuple[str, tuple[str, ...]]]:
        # A fetch that failed changed no model: its reason is the fetch's message.
        return [(SERVED, ("add",))] if outcome == "completed" else []


class Update(Operation):
    """`model update` of the served model to the weights just pushed to the registry: their
    fetch into the mirror, the swap, then the replicas replaced one at a time. Completed: the
    rollout done and every replica on the new weights; failed: the rollout failed or halted
    with its message, the replicas on the old weights."""

    traffic = ("chat", SERVED)
    body: dict[str, Any] = {}

    def prepare(self) -> None:
        self.fleet.serve()
        self.old_seed = self.fleet.head_seed
        self.new_seed = self.fleet.push_weights()

    def start(self) -> None:
        self.wanted = {"chat": 1, SERVED: SERVED_REPLICAS}
        self.fleet.sys.api("POST", f"models/{SERVED}/update", json=self.body)

    def rollout(self) -> dict[str, Any]:
        return self.fleet.sys.api("GET", f"models/{SERVED}/rollout")

    def phase(self) -> str:
        rollout = self.rollout()
        fetch = rollout["fetch"] or {}
        got = f" ({fetch.get('bytes_done')} of {fetch.get('bytes_total')} bytes)" if fetch else ""
        return f"rollout {rollout['state']}: {rollout['step']}{got}"

    def engines(self) -> list[dict[str, Any]] | None:
        """The served model's ready replicas on the new weights when there are (the replaced
        ones, the canary), else its ready ones."""
        ready = [{**r, "model": SERVED} for r in self.fleet.replicas(SERVED) if r["routable"]]
        new = self.fleet.weights_sha256(self.new_seed)
        return [r for r in ready if r["weights_sha256"] == new] or ready or None

    def settled_on(self, seed: int) -> bool:
        return self.fleet.settled(self.wanted) and self.fleet.on_weights(seed)

    def ended(self) -> tuple[str, str] | None:
        rollout = self.rollout()
        if rollout["kind"] == "rollback":  # the latest rollout: a rollback stopped the update
            if rollout["state"] == "done" and self.settled_on(self.old_seed):
                return f"failed: rolled back: {rollout['message']}", rollout["message"]
            return None
        if rollout["state"] == "done" and self.settled_on(self.new_seed):
            return "completed", rollout["message"]
        if rollout["state"] in ("failed", "halted") and self.settled_on(self.old_seed):
            return f"failed: rollout {rollout['state']}: {rollout['message']}", rollout["message"]
        return None

    def failure(self) -> str:
        rollout = self.rollout()
        if rollout["state"] in ("failed", "halted"):
            return f"failed: {rollout['kind']} {rollout['state']}: {rollout['message']}"
        return super().failure()

    def audit(self, outcome: str) -> list[tuple[str, tuple[str, ...]]]:
        end = (
            ("update-done",)
            if outcome == "completed"
            else ("update-failed", "update-halted", "rollback")
        )
        return [(SERVED, ("update",)), (SERVED, end)]


class UpdateFetch(Update):
    """The fault lands while the new files are fetched (FETCH_SECONDS, the registry's proxy
    slows it down): within most of that after asking (`phase` says whether it still was)."""

    name = "update-fetch"

    def aim(self, rng: random.Random) -> None:
        time.sleep(rng.uniform(0, FETCH_SECONDS * 0.8))  # time is tested: the fault's moment


class UpdateRoll(Update):
    """The fault lands while the replicas are replaced: once the API shows the rollout
    rolling, within 3 s."""

    name = "update-roll"

    def aim(self, rng: random.Random) -> None:
        with contextlib.suppress(AssertionError):
            wait_for(
                lambda: self.rollout()["state"] != "fetching",
                timeout=60,
                interval=0.1,
                what="the rollout to replace replicas",
            )
        time.sleep(rng.uniform(0, 3.0))  # time is tested: the fault's moment


class Canary(Update):
    """`model update --canary 50 --for 10s`: the fault lands in the window (once the API shows
    the canary watching, within its length). It must end promoted (then completed as any
    update) or rolled back (failed, with the decision), recorded either way."""

    name = "canary"
    body = CANARY

    def canary(self) -> dict[str, Any]:
        return self.fleet.sys.api("GET", f"models/{SERVED}/canary")

    def aim(self, rng: random.Random) -> None:
        with contextlib.suppress(AssertionError):
            wait_for(
                lambda: self.canary()["state"] != "waiting",
                timeout=90,
                interval=0.2,
                what="the canary's window to start",
            )
        time.sleep(rng.uniform(0, CANARY_WINDOW_SECONDS))  # time is tested: the fault's moment

    def phase(self) -> str:
        canary = self.canary()
        if canary["state"] != "watching":
            return f"canary {canary['state']}: {canary['decision'] or canary['verdict']}"
        started = datetime.fromisoformat(canary["started_at"].replace("Z", "+00:00"))
        # By the control plane's clock, which stamped the start (stepped in the clock cells).
        now = datetime.now(UTC) + timedelta(seconds=self.fleet.clocks.get("plane", 0))
        into = (now - started).total_seconds()
        return (
            f"canary watching, {into:.1f}s into its {canary['window']} window, "
            f"{canary['new']['requests']} answers from the new revision"
        )

    def ended(self) -> tuple[str, str] | None:
        canary = self.canary()
        if canary["state"] in ("waiting", "watching"):
            return None
        decided = f"canary {canary['state']}: {canary['decision']}"
        if canary["state"] == "promoted":
            ended = super().ended()
            return (ended[0], f"{decided}; {ended[1]}") if ended else None
        if self.settled_on(self.old_seed):
            return f"failed: {decided}", decided
        return None

    def failure(self) -> str:
        canary = self.canary()
        if canary["state"] not in ("waiting", "watching", "promoted"):
            return f"failed: canary {canary['state']}: {canary['decision']}"
        return super().failure()

    def audit(self, outcome: str) -> list[tuple[str, tuple[str, ...]]]:
        if outcome == "completed":
            return [
                (SERVED, ("canary",)),
                (SERVED, ("canary-promote",)),
                (SERVED, ("update-done",)),
            ]
        return [(SERVED, ("canary",)), (SERVED, ("canary-rollback", "canary-end"))]


OPERATION_KINDS: dict[str, type[Operation]] = {
    kind.name: kind for kind in (Scale, Add, Serve, UpdateFetch, UpdateRoll, Canary)
}
assert tuple(OPERATION_KINDS) == OPERATIONS


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


def _audit_missing(fleet: Fleet, operation: Operation, outcome: str, since: int) -> str:
    """What the audit lacks of the operation's entries written after entry `since`."""
    missing = []
    with contextlib.suppress(requests.RequestException, AssertionError):
        for model, actions in operation.audit(outcome):
            entries = fleet.sys.api("GET", "audit", params={"model": model})["entries"]
            seen = [e["action"] for e in entries if e["id"] > since]
            if not set(actions) & set(seen):
                missing.append(f"no {' or '.join(actions)} entry for {model}: {seen[:8]}")
        return "; ".join(missing)
    return "the audit could not be read"


def _change_after_step(fleet: Fleet, op: Operation) -> str:
    """'' when a change asked after the clock stepped ("chat" given one replica more) is carried
    out within AFTER_STEP_SECONDS: the reconciler, its lease and the nodes' orders still work by
    the new time, whenever in the operation the step landed (reset() takes the replica away)."""
    wanted = {**op.wanted, "chat": op.wanted["chat"] + 1}
    try:
        fleet.sys.api("POST", "models/chat/scale", json={"min": wanted["chat"]})
        fleet.wait_settled(wanted, timeout=AFTER_STEP_SECONDS)
    except AssertionError as exc:
        asked = f"chat scaled to {wanted['chat']} after the step"
        return f"{asked}: not done in {AFTER_STEP_SECONDS:.0f} s ({exc})"[:400]
    op.wanted = wanted
    return ""


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
    [value] = waiting.wait_for(
        lambda: [read()],  # a list, since what is read may be falsy (no orphans: [])
        timeout=20,
        interval=0.5,
        what=f"the API to answer {read}",
        not_yet=(AssertionError, requests.RequestException),
    )
    return value


def run_cell(fleet: Fleet, fault: str, operation: str, seed: int) -> CellResult:
    rng = random.Random(f"{seed}:{fault}:{operation}")
    result = CellResult(fault, operation, seed)
    op = OPERATION_KINDS[operation](fleet)
    fleet.arrange(fault)
    op.prepare()
    restarted_before = len(fleet.restarted)
    key = fleet.key
    if fault in CLOCK_FAULTS:
        key, expires = fleet.cell_key(f"clock-{seed}-{fault}-{operation}")
        result.fault_note = f"clients' key expires {expires}; "
    worker_offset = fleet.sys.logs["worker"].stat().st_size
    beat_offset = fleet.schedule_log().stat().st_size
    with Traffic(fleet.sys.url, key, models=op.traffic) as traffic:
        opened = time.monotonic()
        wait_for(
            lambda: traffic.answered_since(opened) >= TRAFFIC_CLIENTS,
            timeout=CLIENT_TIMEOUT + 10,
            interval=0.05,
            what="the traffic flowing: an answer to each client",
        )
        audit_since = fleet.last_audit_id()
        op.start()
        op.aim(rng)
        try:
            result.phase = op.phase()
        except (AssertionError, requests.RequestException) as exc:
            result.phase = f"not read: {exc}"[:200]
        fault_at = time.monotonic()
        engines = _read(op.engines) if fault == "engine" else None
        note, saved = fleet.inject(fault, rng, engines)
        result.fault_note += note
        down = DOWN_SECONDS.get(fault, DEFAULT_DOWN_SECONDS)
        time.sleep(down)  # time is what is tested: the part stays down this long
        fleet.restore(fault, saved)
        log_offset = fleet.schedule_log().stat().st_size
        settled_at = float("inf")

        def ended() -> tuple[str, str] | None:
            fleet.tend()
            try:
                return op.ended()
            except AssertionError:  # the API answered an error: a process is not back yet
                return None

        try:
            result.outcome, result.ending = wait_for(
                ended, timeout=OPERATION_TIMEOUT, interval=0.5, what=f"{operation} to end"
            )
            settled_at = time.monotonic()
            result.recover_seconds = round(settled_at - fault_at, 1)
        except AssertionError:
            result.outcome = _read(op.failure)
        # A little traffic after it settled: the gateway must serve it all.
        after = time.monotonic()
        wait_for(
            lambda: traffic.answered_since(after) >= SETTLED_ANSWERS,
            timeout=CLIENT_TIMEOUT + 10,
            interval=0.05,
            what=f"{SETTLED_ANSWERS} requests sent after the operation ended answered",
        )
    if fault in SCHEDULE_FAULTS:

        def sent() -> bool:
            fleet.tend()  # as the run command does meanwhile (a worker whose beat died)
            return fleet.schedule_sends_since(log_offset)

        try:
            wait_for(sent, timeout=SCHEDULE_BACK_SECONDS, what="a periodic task sent")
        except AssertionError:
            result.schedule = f"no periodic task sent in {SCHEDULE_BACK_SECONDS:.0f}s after"
    if fault in CLOCK_FAULTS:
        result.after_step = _change_after_step(fleet, op)
    fleet.tend()
    result.restarted = fleet.restarted[restarted_before:]
    result.double_placements = _read(lambda: fleet.double_placements(op.wanted))
    result.orphans = _read(fleet.orphan_engines)
    result.audit_missing = _audit_missing(fleet, op, result.outcome, audit_since)
    if fault in NEW_FAULTS:
        result.nodes_lost = fleet.nodes_lost_since(worker_offset)
        result.held_by_two = fleet.held_by_two_since(worker_offset, beat_offset)
    if fault in DATABASE_FAULTS:
        result.gateway = fleet.gateway_follows()
    result.sent = len(traffic.answers)
    failures = [a for a in traffic.answers if a.status != 200]
    result.failed = len(failures)
    unexcused = [a for a in failures if not _excuse(fault, a, fault_at, settled_at)]
    result.excused = result.failed - len(unexcused)
    result.statuses = dict(Counter(str(a.status or "no answer") for a in failures))
    result.unexcused = [
        f"t{a.started - fault_at:+.1f}s {a.model} {a.status} {a.error}" for a in unexcused
    ]
    return result


@contextlib.contextmanager
def fleet_in(folder: Path) -> Iterator[Fleet]:
    with Fleet(folder) as fleet:
        try:
            yield fleet
        except BaseException:
            print(fleet.sys.log_tail() if fleet.system else "")
            raise
