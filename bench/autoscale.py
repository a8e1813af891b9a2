"""The autoscale policy against fake engines of known capacity, in one run: the real gateway (the
run command's uvicorn, 2 workers, its fair queue writing the queue figures), the real reconciler
and autoscaler (fleet.reconcile_pass every 5 s, the product's default interval), on a SQLite
database, with this process standing in for a node agent: each replica it is told to run is a
fake engine (bench/fairness.py's: 4 slots, answers in 0.8-1.2 s, so 4 answers a second, a
first-come queue behind its slots), reported ready once it answers /health, stopped once the
control plane no longer lists it.

The model: min 1, max 4, 4 slots a replica, a policy of wait 2s, up after 30s, down after 60s
(the default down window is 10m; a shorter one keeps the run short and changes nothing else).
Closed-loop clients (each sends one request after another): N clients on 4N/4 slots wait about
(N - slots) / 4 s each.

Phases, in order:
  off    the policy off, 16 clients (4x a replica's capacity) for 60 s: the seed's rule, nothing
         changes;
  step   the policy on, 16 clients: when the second replica serves against when the up window
         ended (target: within the engine's start + 10 s), and when the wait is back under 2 s
         (target: within 60 s);
  down   2 clients: the spare replicas go (one step per down window), 0 failed requests;
  swing  10 and 14 clients in turn every 30 s, around the threshold of one replica (12 clients
         wait 2 s), for 10 minutes (3 with --quick): at most 2 changes (target).
Every request's answer is counted: the target is 0 failed in every phase.

Also measured (--engines, or in a full run): the real engine's start on the tiny test model and
on the ~50 MB one, llama-server from its command to /health answering, 5 rounds each, the
files in the page cache (read once before): what a new replica costs before it can serve.

Run: make bench, or .venv/bin/python bench/autoscale.py [--quick] [--engines]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import (  # noqa: E402
    DATABASE_PRELUDE,
    WORKERS,
    Processes,
    free_port,
    gateway_env,
    prepare_database,
    wait_http,
)

MODEL = "auto"
SLOTS = 4
WAIT = 2
UP_AFTER = 30
DOWN_AFTER = 60
PASS_SECONDS = 5.0  # the reconcile interval's default (cluster.reconcile_interval)
BEAT_SECONDS = 1.0


def prepare(folder: Path) -> tuple[dict[str, str], str]:
    env = gateway_env(folder)
    script = (
        DATABASE_PRELUDE
        + f"""
node.memory_gb, node.cores = 64, 16
node.save()
model_add(actor=actor, source_check=False, definition=clean_definition({{
    "name": "{MODEL}", "source": "http://127.0.0.1:9/bench.gguf", "min_replicas": 1,
    "max_replicas": 4, "profiles": [{{"name": "cpu", "memory_gb": 1, "cores": 1,
    "slots": {SLOTS}}}]}}))
print(key_create(actor=actor, name="autoscale")[1])
"""
    )
    return env, prepare_database(script, env)


# -- the stand-in node agent -----------------------------------------------------------


@dataclass
class Engine:
    process: subprocess.Popen[bytes]
    port: int
    asked_at: float
    ready_at: float | None = None


class Agent:
    """Node "bench": a heartbeat every BEAT_SECONDS, an engine per replica it is told to run."""

    def __init__(self, processes: Processes) -> None:
        self.processes = processes
        self.engines: dict[str, Engine] = {}
        self.starts: list[float] = []  # seconds from the order to /health answering
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from django.db import close_old_connections

        while not self.stop.wait(BEAT_SECONDS):
            try:
                self.beat()
            except Exception as exc:  # a locked SQLite database: the next beat says it again
                print(f"  (heartbeat failed: {exc!r})", flush=True)
            finally:
                close_old_connections()

    def beat(self) -> None:
        import requests

        from fleet.models import Node
        from fleet.services import node_heartbeat

        node = Node.objects.get(name="bench")
        for engine in self.engines.values():
            if engine.ready_at is None:
                with contextlib.suppress(requests.RequestException):
                    if requests.get(f"http://127.0.0.1:{engine.port}/health", timeout=1).ok:
                        engine.ready_at = time.monotonic()
                        self.starts.append(engine.ready_at - engine.asked_at)
        report = {
            "capacity": {"memory_gb": 64, "cores": 16, "gpus": 0, "gpu_memory_gb": 0},
            "replicas": [
                {
                    "id": rid,
                    "state": "ready" if e.ready_at is not None else "starting",
                    "port": e.port,
                    "message": "",
                }
                for rid, e in self.engines.items()
            ],
        }
        answer = node_heartbeat(node=node, report=report, interval=2)
        wanted = {order["id"] for order in answer["replicas"]}
        for rid in wanted - self.engines.keys():
            port = engine_port({e.port for e in self.engines.values()})
            argv = [sys.executable, str(ROOT / "bench" / "fairness.py"), "--engine", str(port)]
            self.processes.start(f"engine-{rid[:8]}", argv)
            process = self.processes.running[f"engine-{rid[:8]}"]
            self.engines[rid] = Engine(process, port, time.monotonic())
        for rid in self.engines.keys() - wanted:
            engine = self.engines.pop(rid)
            engine.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                engine.process.wait(timeout=10)

    def answered(self) -> dict[str, int]:
        """Answers each ready engine gave, by replica id."""
        import requests

        counts = {}
        for rid, engine in list(self.engines.items()):
            with contextlib.suppress(requests.RequestException):
                stats = requests.get(f"http://127.0.0.1:{engine.port}/_stats", timeout=2).json()
                counts[rid] = stats["answered"]
        return counts


def engine_port(taken: set[int]) -> int:
    """A free port in the agent's default range (fleet.trust routes only those)."""
    import socket

    for port in range(41000, 42000):
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 41000-41999")


class ControlPlane:
    """The reconcile pass every PASS_SECONDS, as beat runs it."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from django.db import close_old_connections

        from fleet.reconciler import reconcile_pass

        while not self.stop.wait(PASS_SECONDS):
            try:
                reconcile_pass(periodic=True)
            except Exception as exc:
                print(f"  (reconcile pass failed: {exc!r})", flush=True)
            finally:
                close_old_connections()


# -- the load ----------------------------------------------------------------------------


@dataclass
class Load:
    """Closed-loop clients through the gateway; `clients` can change while it runs."""

    url: str
    key: str
    clients: int = 0
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # of the answers, in order
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def set(self, clients: int) -> None:
        self.clients = clients
        while len(self.threads) < clients:
            thread = threading.Thread(target=self._run, args=(len(self.threads),), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _run(self, number: int) -> None:
        import requests

        session = requests.Session()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {self.key}"}
        while not self.stop.is_set():
            if number >= self.clients:
                self.stop.wait(0.2)
                continue
            try:
                sent = time.monotonic()
                response = session.post(
                    f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=120
                )
                if response.status_code == 200:
                    self.latencies.append(time.monotonic() - sent)
                    self.ok += 1
                else:
                    self.failed.append(f"{response.status_code} {response.text[:120]}")
            except requests.RequestException as exc:
                self.failed.append(repr(exc))


# -- watching ------------------------------------------------------------------------------


def state() -> tuple[int, dict[str, Any]]:
    """(replicas wanted, the autoscale state) as the database has them now."""
    from django.utils import timezone

    from catalog.config import current_config
    from catalog.models import Model

    model = Model.objects.get(name=MODEL)
    wanted = model.desired_replicas(timezone.now(), current_config().default_idle_timeout)
    return wanted, model.autoscale_state or {}


def set_policy(on: bool) -> None:
    from catalog.services import model_autoscale
    from core.actor import SYSTEM

    policy = {"wait": f"{WAIT}s", "up_after": f"{UP_AFTER}s", "down_after": f"{DOWN_AFTER}s"}
    model_autoscale(actor=SYSTEM, name=MODEL, policy=policy if on else None)


@dataclass
class Phase:
    name: str
    changes: list[tuple[float, int]] = field(default_factory=list)  # (second, wanted)
    p50s: list[tuple[float, float | None]] = field(default_factory=list)
    failed: int = 0
    ok: int = 0
    latencies: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    begun: float = field(default_factory=time.monotonic)
    wanted_at_start: int = field(default_factory=lambda: state()[0])


def watch(phase: Phase, seconds: float, load: Load, agent: Agent, *, every: float = 1.0,
          until: Any = None) -> None:  # fmt: skip
    """Look every `every` s for `seconds` (or until `until()`): the wanted count's changes and
    the autoscaler's p50 wait."""
    from django.db import close_old_connections

    start = time.monotonic()
    ok0, failed0 = load.ok, len(load.failed)
    last = phase.changes[-1][1] if phase.changes else phase.wanted_at_start
    while time.monotonic() - start < seconds:
        time.sleep(every)
        wanted, st = state()
        at = time.monotonic() - phase.begun
        if wanted != last:
            phase.changes.append((at, wanted))
            last = wanted
        phase.p50s.append((at, (st.get("figures") or {}).get("wait_p50_seconds")))
        close_old_connections()
        if until is not None and until():
            break
    phase.ok += load.ok - ok0
    phase.failed += len(load.failed) - failed0
    phase.latencies += load.latencies[len(load.latencies) - (load.ok - ok0) :]


# -- the engine's own start ----------------------------------------------------------------------


def engine_starts(rounds: int = 5) -> list[tuple[str, float, float]]:
    """llama-server from its command to /health answering: (model, median ms, max ms)."""
    import requests

    from llmgw.engines import EngineSettings, get_engine
    from llmgw.tinygguf import LARGE, write_tiny_model

    engine = get_engine()
    executable = engine.find()
    if executable is None:
        return []
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-wake-") as tmp:
        for name, shape in (("tiny (0.7 MB)", None), ("larger (~50 MB)", LARGE)):
            path = Path(tmp) / f"{len(rows)}.gguf"
            write_tiny_model(path, **({"shape": shape} if shape else {}))
            path.read_bytes()  # in the page cache, as on a node that fetched it
            times = []
            for _ in range(rounds):
                port = free_port()
                settings = EngineSettings(str(path), "m", "127.0.0.1", port, 512, slots=4)
                begun = time.monotonic()
                process = subprocess.Popen(
                    engine.command(settings, executable),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env={**os.environ, **engine.environment(settings)},
                )
                try:
                    while True:
                        with contextlib.suppress(requests.RequestException):
                            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                                break
                        if time.monotonic() - begun > 60:
                            raise RuntimeError("llama-server did not answer /health in 60 s")
                        time.sleep(0.01)
                    times.append((time.monotonic() - begun) * 1000)
                finally:
                    process.terminate()
                    process.wait(timeout=10)
            rows.append((name, statistics.median(times), max(times)))
    return rows


# -- the run ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 3-minute swing instead of 10")
    parser.add_argument("--engines", action="store_true", help="only the engine's start")
    args = parser.parse_args()
    if args.engines:
        _print_engines()
        return 0
    swing_minutes = 3 if args.quick else 10
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-autoscale-") as tmp:
        folder = Path(tmp)
        processes = Processes(folder)
        try:
            env, key = prepare(folder)
            os.environ.update(env)
            os.environ["DJANGO_SETTINGS_MODULE"] = "llmgw_site.settings"
            import django

            django.setup()
            from llmgw_site.management.commands.llmgw_run import gateway_command

            port = free_port()
            argv = gateway_command(Path(sys.executable).parent, "127.0.0.1", port, workers=WORKERS)
            processes.start("gateway", argv, env)
            url = f"http://127.0.0.1:{port}"
            agent, control = Agent(processes), ControlPlane()
            agent.thread.start()
            control.thread.start()
            load = Load(url, key)
            wait_http(f"{url}/metrics", "the gateway")
            phases = run_phases(load, agent, swing_minutes)
            load.stop.set()
            control.stop.set()
            agent.stop.set()
            report(phases, agent)
        finally:
            processes.stop_all()
    _print_engines()
    return 0


def run_phases(load: Load, agent: Agent, swing_minutes: int) -> list[Phase]:
    phases = []
    print("waiting for the first replica to serve...", flush=True)
    first = Phase("start")
    watch(
        first, 120, load, agent, until=lambda: any(agent.answered().values()) or _one_ready(agent)
    )

    off = Phase("off")
    print("off: 16 clients for 60 s, no policy", flush=True)
    load.set(16)
    watch(off, 60, load, agent)
    phases.append(off)

    step = Phase("step")
    print("step: the policy on, 16 clients", flush=True)
    set_policy(True)
    begun = time.monotonic()
    window_end: float | None = None
    serving: float | None = None
    under: float | None = None
    while time.monotonic() - begun < 240:
        watch(step, 1, load, agent)
        _, st = state()
        if window_end is None and st.get("above_since"):
            from datetime import datetime

            above = datetime.fromisoformat(st["above_since"]).timestamp()
            window_end = time.monotonic() - (time.time() - above) + UP_AFTER
        counts = agent.answered()
        if serving is None and len([c for c in counts.values() if c > 0]) >= 2:
            serving = time.monotonic()
        p50 = (st.get("figures") or {}).get("wait_p50_seconds")
        if serving is not None and under is None and p50 is not None and p50 < WAIT:
            under = time.monotonic()
        if under is not None and time.monotonic() - under > 20:
            break
    start_ms = statistics.median(agent.starts) * 1000 if agent.starts else float("nan")
    if window_end is not None and serving is not None:
        late = serving - window_end
        step.notes.append(
            f"second replica serving {late:+.1f} s after the up window ended "
            f"(target: within the engine's start {start_ms / 1000:.1f} s + 10 s)"
        )
    else:
        step.notes.append(f"up window end {window_end}, second replica serving {serving}")
    if window_end is not None and under is not None:
        step.notes.append(
            f"wait back under {WAIT} s {under - window_end:.1f} s after the window ended "
            "(target: within 60 s)"
        )
    phases.append(step)

    down = Phase("down")
    print("down: 2 clients until one replica is left", flush=True)
    load.set(2)
    watch(down, 3 * DOWN_AFTER + 60, load, agent, until=lambda: state()[0] == 1)
    watch(down, 15, load, agent)  # the last one drains
    phases.append(down)

    swing = Phase("swing")
    print(f"swing: 10 and 14 clients in turn every 30 s for {swing_minutes} min", flush=True)
    for turn in range(swing_minutes * 2):
        load.set(14 if turn % 2 == 0 else 10)
        load.clients = 14 if turn % 2 == 0 else 10
        watch(swing, 30, load, agent)
    phases.append(swing)
    return phases


def _one_ready(agent: Agent) -> bool:
    return any(e.ready_at is not None for e in agent.engines.values())


def report(phases: list[Phase], agent: Agent) -> None:
    starts = agent.starts
    print()
    print(f"fake engine start (order to /health): median {statistics.median(starts):.2f} s")
    print("wait p50: the median over the phase of the autoscaler's p50 queue wait (its figures)")
    print("latency p50: the clients' own, of an answer that takes 0.8-1.2 s at the engine")
    print(
        f"{'phase':<7} {'changes':<22} {'ok':>6} {'failed':>6} {'wait p50':>9} "
        f"{'latency p50':>12}  target"
    )
    targets = {
        "off": "no change (the policy off)",
        "step": "1 change up; 0 failed",
        "down": "back to 1; 0 failed",
        "swing": "at most 2 changes; 0 failed",
    }
    for phase in phases:
        changes = ", ".join(f"{n} at {t:.0f}s" for t, n in phase.changes) or "none"
        seen = [p for _, p in phase.p50s if p is not None]
        wait = f"{statistics.median(seen):.1f} s" if seen else "-"
        latency = f"{statistics.median(phase.latencies):.2f} s" if phase.latencies else "-"
        print(
            f"{phase.name:<7} {changes:<22} {phase.ok:>6} {phase.failed:>6} {wait:>9} "
            f"{latency:>12}  {targets[phase.name]}"
        )
        for note in phase.notes:
            print(f"        {note}")
    p50s = [p for _, p in phases[-1].p50s if p is not None]
    if p50s:
        print(f"swing: the autoscaler's p50 wait ranged {min(p50s):.1f}-{max(p50s):.1f} s")


def _print_engines() -> None:
    rows = engine_starts()
    if not rows:
        print("engine start: skipped, llama-server is not built (make setup builds it)")
        return
    print("llama-server's start, command to /health answering (5 rounds, files cached):")
    for name, median, worst in rows:
        print(f"  {name:<16} median {median:6.0f} ms   max {worst:6.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
