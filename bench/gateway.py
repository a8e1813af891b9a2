"""What the gateway adds, measured the way LiteLLM's proxy benchmarks measure a proxy: against a
fast fake upstream (bench/fake_upstream.py, no model), the same requests sent straight to it, through
llmgw's gateway and through LiteLLM's proxy, in alternating rounds.

The gateway runs as the run command starts it (uvicorn, 2 worker processes) on a SQLite database
with one replica of each bench model pointing at the fake upstream. LiteLLM's proxy (litellm[proxy],
pinned to LITELLM_VERSION, 2 workers, no database) gets the same two models. LiteLLM is installed into a venv of its own
(LLMGW_BENCH_LITELLM_VENV, default /tmp/llmgw-bench-litellm) the first time, in the background while
the rest starts; when it cannot be installed the bench says so and measures without it.

Modes: streamed with 50 ms between the 20 events (about 1 s per stream), streamed without delay,
and whole (non-streamed) answers. Per concurrency it prints the latency added over going direct
(p50/p99, to the last byte and to the first byte), throughput as a share of direct, errors, the
most streams the upstream had open at once, wall time over the ideal (50 ms streams only), and the
CPU milliseconds per request of the proxy's processes, with the targets of issue 10 beside them.

Then what a key's limits cost a request: whole answers through the gateway, in interleaved rounds,
with the key above (no limits) and with a key whose rpm, tpm and max_parallel are far above what
the bench sends, in a team with an rpm (so that every check runs and none refuses), at 1 and 32
clients: each key's median and p99, CPU per request, and the added median beside its target.
The same gateway with tracing on ('traced', exporting to an OTLP receiver) is a path of every
cell and of the limits section: what tracing costs, alone and with the limits, in the same run
(--no-traced leaves it out).

Run: make bench, or .venv/bin/python bench/gateway.py [--quick] [--levels 1,8,32,128,512];
--only-limits --baseline REV measures the limits section alone, on this revision and REV's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.otlp import OtlpReceiver  # noqa: E402
from tests.support.system import run_python  # noqa: E402

MODES = {
    # name: (model, stream, description)
    "stream 50ms": ("bench-slow", True, "streamed, 20 events 50 ms apart (about 1 s per stream)"),
    "stream fast": ("bench-fast", True, "streamed, 20 events without delay"),
    "whole": ("bench-fast", False, "not streamed"),
}
STREAM_SECONDS = 20 * 0.05
LEVELS = [1, 8, 32, 128, 512]
LITELLM_VENV = Path(os.environ.get("LLMGW_BENCH_LITELLM_VENV", "/tmp/llmgw-bench-litellm"))
# The LiteLLM the figures were measured against: a figure beside "LiteLLM" means this version.
# The newest whose proxy extra installs on Python 3.11 from the package index (checked with
# `pip install --dry-run 'litellm[proxy]==1.108.7'`, 2026-12-04; 1.109 and later need
# litellm-proxy-extras versions the index did not have). Raise it deliberately, not by chance.
LITELLM_VERSION = "1.108.7"
LITELLM_INSTALL_SECONDS = 600
WORKERS = 2
LITELLM_KEY = "sk-llmgw-bench-0123456789abcdef0123456789abcdef"
# The fake upstream answers every request at once: its replicas say they have slots for more
# than the most clients, so that the gateway sends each request on as it comes (with one slot,
# the gateway's fair queue would hold all but one, as it should for an engine that computes one
# at a time) and the bench measures what the gateway adds, not a queue.
UPSTREAM_SLOTS = 4096

# What a key's limits cost a request (issue 21; issue 37, with reservations of tokens): the
# clients, and the most they may add at one.
LIMIT_LEVELS = (1, 32)
TARGET_LIMITS_ADDED_MS = 0.15
# The limited key's and its team's figures: far above anything the bench sends, so that every
# limit is counted and checked and none refuses.
LIMITED_KEY = "rpm=10**9, tpm=10**12, max_parallel=10**6"
LIMITED_TEAM = "rpm=10**9"
# The two keys compared: the label printed, and the key's name in prepare_gateway_keys.
LIMIT_KEYS = {"no limits": "bench", "limited": "limited"}

TARGETS = (
    "targets (issue 10): 512 concurrent 1-s streams: wall/ideal <= 1.5, all 512 open at once, "
    "0 errors;\n  whole answers: added p50 <= 1.0 ms at 1 client, CPU <= 1.5 ms per request; "
    "every cell ahead of LiteLLM on added latency, throughput ratio and CPU;\n  (issue 23) "
    "with tracing off, added p50 <= 0.02 ms over the revision before it (--baseline REV); "
    "with tracing on (--traced), what it adds printed beside it"
)
TARGET_TRACING_OFF_MS = 0.02


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- measuring ------------------------------------------------------------------------------


@dataclass
class Sample:
    totals: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    requests: int = 0
    cpu: float = 0.0
    most_open: int = 0
    walls: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return len(self.totals) / self.seconds if self.seconds else 0.0


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


async def one_request(
    session: Any, url: str, headers: dict[str, str], body: bytes, into: Sample
) -> None:
    import aiohttp

    started = time.perf_counter()
    first = None
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                await response.read()
                into.errors += 1
                return
            async for _ in response.content.iter_any():
                if first is None:
                    first = time.perf_counter() - started
    except (TimeoutError, aiohttp.ClientError, OSError):
        into.errors += 1
        return
    into.totals.append(time.perf_counter() - started)
    into.firsts.append(first if first is not None else time.perf_counter() - started)


async def run_cell(
    session: Any,
    url: str,
    headers: dict[str, str],
    body: bytes,
    clients: int,
    count: int,
    into: Sample,
) -> None:
    left = count

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one_request(session, url, headers, body, into)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    into.seconds += elapsed
    into.walls.append(elapsed)
    into.requests += count


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and all its descendants, so far: the scheduler's nanoseconds on a
    CPU of each of their threads (/proc/PID/task/TID/schedstat). /proc/PID/stat counts user and
    system time in clock ticks (10 ms): a round of 300 whole answers at 1 client is about 90 ms
    of a gateway's CPU, read by three processes' ticks, so a tick's rounding alone moved its CPU
    per request by a tenth of a millisecond. (A thread that ends between two readings takes its
    time with it; the processes measured keep theirs.)"""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                total += int((task / "schedstat").read_text().split()[0]) / 1e9
                pending += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


# -- the processes --------------------------------------------------------------------------


class Processes:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT
    ) -> int:
        log = (self.folder / f"{name}.log").open("ab")
        self.running[name] = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env or dict(os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self.running[name].pid

    def pid(self, name: str) -> int:
        return self.running[name].pid

    def stop_all(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.running.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)

    def log_tail(self, name: str) -> str:
        path = self.folder / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-20:]) if path.exists() else ""
        )


def wait_http(
    url: str, what: str, timeout: float = 90, headers: dict[str, str] | None = None
) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            request = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout:.0f}s")


def start_upstreams(processes: Processes) -> tuple[int, int]:
    """Two fake upstreams (bench/fake_upstream.py), answering: their ports."""
    ports = free_port(), free_port()
    for name, port in zip(("upstream", "upstream-2"), ports, strict=True):
        processes.start(name, [sys.executable, str(ROOT / "bench" / "fake_upstream.py"), str(port)])
        wait_http(f"http://127.0.0.1:{port}/health", "the fake upstream")
    return ports


# What every bench database starts with: migrated, an admin, its actor and one node ("bench").
DATABASE_PRELUDE = """
import django, os
os.environ["DJANGO_SETTINGS_MODULE"] = "llmgw_site.settings"
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django.contrib.auth import get_user_model
from django.utils import timezone
from catalog.definitions import clean_definition
from catalog.models import Model
from core.actor import Actor
from catalog.services import model_add
from fleet.models import Node, Replica, hash_token
from access.services import key_create
user = get_user_model().objects.create_superuser("bench", password="bench-password-1")
actor = Actor.for_user(user, "api")
node = Node.objects.create(name="bench", token_hash=hash_token("bench"), address="127.0.0.1",
    memory_gb=8, cores=2, last_heartbeat=timezone.now())
"""


def gateway_env(folder: Path) -> dict[str, str]:
    """The environment of a bench gateway: its own SQLite database and var/ in `folder`."""
    return {
        **{
            k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "LLMGW", "DATABASE"))
        },
        "DATABASE_URL": f"sqlite:///{folder / 'gateway.sqlite3'}",
        "LLMGW_VAR_DIR": str(folder / "var"),
        "LLMGW_CONFIG": "/nonexistent/server.yaml",
        "LLMGW_METRICS_DIR": str(folder / "metrics"),
        "LLMGW_METRICS_OPEN": "true",
        "LLMGW_SECRET_KEY": "bench-secret-key",
    }


def prepare_database(script: str, env: dict[str, str]) -> str:
    """Run a Django script that fills the bench database; returns its last line (a key)."""
    done = run_python(script, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"could not prepare the gateway's database:\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def prepare_gateway(
    folder: Path, upstream_port: int, second_port: int
) -> tuple[dict[str, str], str]:
    """A database with the bench models, one replica each on the fake upstream, and a key;
    and "bench-pair" with two replicas, one on each fake upstream, to measure the spread."""
    env, secrets = prepare_gateway_keys(folder, upstream_port, second_port)
    return env, secrets["bench"]


def prepare_gateway_keys(
    folder: Path, upstream_port: int, second_port: int
) -> tuple[dict[str, str], dict[str, str]]:
    """prepare_gateway's database, with its key ("bench", no limits) and a "limited" one (see
    LIMITED_KEY and LIMITED_TEAM); the environment and the keys by name."""
    env = gateway_env(folder)
    script = (
        DATABASE_PRELUDE
        + f"""
import json
from access.models import GatewayKey, Team
UPSTREAM_SLOTS = {UPSTREAM_SLOTS}
for name, ports in (("bench-slow", [{upstream_port}]), ("bench-fast", [{upstream_port}]),
                    ("bench-pair", [{upstream_port}, {second_port}])):
    model_add(actor=actor, source_check=False, definition=clean_definition({{
        "name": name, "source": "http://127.0.0.1:9/bench.gguf", "min_replicas": len(ports),
        # The spread is least-loaded routing's: every stream here has the same prompt, which
        # prefix routing would keep on one replica while it has free slots (it has thousands).
        "routing": "least_loaded",
        "profiles": [{{"name": "cpu", "memory_gb": 1, "cores": 1}}]}}))
    for port in ports:
        Replica.objects.create(model=Model.objects.get(name=name), model_name=name, node=node,
            profile="cpu", spec={{"slots": UPSTREAM_SLOTS}}, spec_key="bench",
            state=Replica.READY, port=port)
bench = key_create(actor=actor, name="bench")[1]
team = Team.objects.create(name="bench-team", {LIMITED_TEAM})
limited, limited_secret = key_create(actor=actor, name="limited")
GatewayKey.objects.filter(pk=limited.pk).update(team=team, {LIMITED_KEY})
print(json.dumps({{"bench": bench, "limited": limited_secret}}))
"""
    )
    return env, json.loads(prepare_database(script, env))


def litellm_installed() -> bool:
    """LITELLM_VERSION is in the venv (another version there, from before the pin, is not)."""
    found = LITELLM_VENV.glob(f"lib/python*/site-packages/litellm-{LITELLM_VERSION}.dist-info")
    return (LITELLM_VENV / "bin" / "litellm").exists() and any(found)


def litellm_install() -> subprocess.Popen[bytes] | None:
    """Start installing litellm[proxy]==LITELLM_VERSION into its own venv, unless it is there."""
    if litellm_installed():
        return None
    print(
        f"installing litellm[proxy]=={LITELLM_VERSION} into {LITELLM_VENV} in the background ...",
        flush=True,
    )
    venv, pip = shlex.quote(str(LITELLM_VENV)), shlex.quote(str(LITELLM_VENV / "bin" / "pip"))
    command = (
        f"{{ test -x {pip} || python3 -m venv {venv}; }} && "
        f"{pip} install --quiet 'litellm[proxy]=={LITELLM_VERSION}'"
    )
    return subprocess.Popen(
        ["sh", "-c", command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def start_litellm(
    processes: Processes,
    folder: Path,
    upstream_port: int,
    models: tuple[str, ...] = ("bench-slow", "bench-fast"),
) -> str:
    """LiteLLM's proxy with `models`, each sent to the upstream on `upstream_port`."""
    import yaml

    config = {
        "model_list": [
            {
                "model_name": name,
                "litellm_params": {
                    "model": f"openai/{name}",
                    "api_base": f"http://127.0.0.1:{upstream_port}/v1",
                    "api_key": "none",
                },
            }
            for name in models
        ],
        "litellm_settings": {"drop_params": True, "set_verbose": False},
        # It refuses to start without a key; requests send it, as they send llmgw's.
        "general_settings": {"master_key": LITELLM_KEY},
    }
    path = folder / "litellm.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},  # no database for it
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: no fetch of the cost map
        "LITELLM_LOG": "ERROR",
        "NO_DOCS": "True",
    }
    processes.start(
        "litellm",
        [
            str(LITELLM_VENV / "bin" / "litellm"),
            "--config",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            str(WORKERS),
        ],
        env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health/liveliness", "LiteLLM's proxy", timeout=180)
    return url


# -- the run --------------------------------------------------------------------------------


def counts(mode: str, clients: int, quick: bool) -> tuple[int, int]:
    """(rounds, requests per round) for one path in one cell."""
    rounds = 2 if quick else 4
    if mode == "stream 50ms":
        per_round = max(clients, 2 if quick else 4)
    else:
        per_round = max(clients * 2, 100 if quick else 300)
    return rounds, per_round


async def measure(
    paths: dict[str, tuple[str, dict[str, str], int | None]],
    upstream: str,
    levels: list[int],
    quick: bool,
) -> dict[tuple[str, int], dict[str, Sample]]:
    import aiohttp

    results: dict[tuple[str, int], dict[str, Sample]] = {}
    timeout = aiohttp.ClientTimeout(total=300)
    sessions = {
        name: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout, auto_decompress=False
        )
        for name in paths
    }
    stats = aiohttp.ClientSession()
    try:
        # Warm every path: connections, each worker's first request.
        for name, (url, headers, _) in paths.items():
            for model, stream, _ in MODES.values():
                body = request_body(model, stream)
                await run_cell(sessions[name], url, headers, body, 8, 16, Sample())
        for mode, (model, stream, _) in MODES.items():
            body = request_body(model, stream)
            for clients in levels:
                rounds, per_round = counts(mode, clients, quick)
                cell = {name: Sample() for name in paths}
                for _ in range(rounds):
                    for name, (url, headers, pid) in paths.items():
                        async with stats.get(f"{upstream}/_stats?reset") as response:
                            await response.read()
                        before = tree_cpu_seconds(pid) if pid else 0.0
                        await run_cell(
                            sessions[name], url, headers, body, clients, per_round, cell[name]
                        )
                        if pid:
                            cell[name].cpu += tree_cpu_seconds(pid) - before
                        async with stats.get(f"{upstream}/_stats") as response:
                            most = json.loads(await response.read())["most_open"]
                        cell[name].most_open = max(cell[name].most_open, most)
                results[(mode, clients)] = cell
                print(f"  measured {mode} at {clients} clients", file=sys.stderr, flush=True)
    finally:
        for session in sessions.values():
            await session.close()
        await stats.close()
    return results


def request_body(model: str, stream: bool) -> bytes:
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 16,
            "stream": stream,
        }
    ).encode()


def report(
    results: dict[tuple[str, int], dict[str, Sample]], levels: list[int], names: list[str]
) -> None:
    ms = lambda s: f"{s * 1000:.1f}"  # noqa: E731
    proxies = [n for n in names if n != "direct"]
    for mode, (_, stream, description) in MODES.items():
        print(f"\n{mode}: {description}")
        print(
            f"{'clients':>7} {'path':<8}{'n':>6}{'p50 ms':>9}{'+p50':>8}{'+p99':>8}{'+ttfb50':>9}"
            f"{'+ttfb99':>9}{'thr/direct':>11}{'errors':>7}{'open':>6}{'wall/ideal':>11}{'cpu ms/req':>11}"
        )
        for clients in levels:
            cell = results[(mode, clients)]
            direct = cell["direct"]
            d50, d99 = percentile(direct.totals, 0.5), percentile(direct.totals, 0.99)
            f50, f99 = percentile(direct.firsts, 0.5), percentile(direct.firsts, 0.99)
            for name in names:
                sample = cell[name]
                wall = "-"
                if mode == "stream 50ms":
                    rounds = len(sample.walls)
                    per_round = sample.requests // max(1, rounds)
                    ideal = math.ceil(per_round / clients) * STREAM_SECONDS
                    wall = f"{sum(sample.walls) / rounds / ideal:.2f}"
                if name == "direct":
                    added = ("-", "-", "-", "-")
                    ratio, cpu = "1.00", "-"
                else:
                    added = (
                        ms(percentile(sample.totals, 0.5) - d50),
                        ms(percentile(sample.totals, 0.99) - d99),
                        ms(percentile(sample.firsts, 0.5) - f50),
                        ms(percentile(sample.firsts, 0.99) - f99),
                    )
                    ratio = (
                        f"{sample.throughput / direct.throughput:.2f}" if direct.throughput else "-"
                    )
                    cpu = f"{sample.cpu / max(1, sample.requests) * 1000:.2f}"
                print(
                    f"{clients:>7} {name:<8}{sample.requests:>6}{ms(percentile(sample.totals, 0.5)):>9}"
                    f"{added[0]:>8}{added[1]:>8}{added[2]:>9}{added[3]:>9}{ratio:>11}{sample.errors:>7}"
                    f"{(sample.most_open if stream else '-')!s:>6}{wall:>11}{cpu:>11}"
                )
    print()
    print(TARGETS)
    verdicts(results, levels, proxies)
    lean_verdicts(results, proxies)


# Issue 39's targets: what the request path costs with limits and tracing off.
LEAN_ADDED_MS, LEAN_CPU_MS, LEAN_THROUGHPUT, LEAN_WALL = 0.5, 0.3, 0.4, 1.2


def lean_verdicts(results: dict[tuple[str, int], dict[str, Sample]], proxies: list[str]) -> None:
    """Issue 39's four targets, for this revision and (with --baseline) the one before it."""
    said = []
    one, many, big = (
        results.get(key) for key in (("whole", 1), ("whole", 32), ("stream 50ms", 512))
    )
    for name in [p for p in ("llmgw", "before", "traced") if p in proxies]:
        parts = []
        if one is not None:
            added = (
                percentile(one[name].totals, 0.5) - percentile(one["direct"].totals, 0.5)
            ) * 1000
            cpu = one[name].cpu / max(1, one[name].requests) * 1000
            parts.append(f"1 client +{added:.2f} ms p50 ({_met(added <= LEAN_ADDED_MS)}), ")
            parts.append(f"{cpu:.2f} ms CPU ({_met(cpu <= LEAN_CPU_MS)})")
        if many is not None and many["direct"].throughput:
            ratio = many[name].throughput / many["direct"].throughput
            parts.append(f"; 32 clients {ratio:.2f} of direct ({_met(ratio >= LEAN_THROUGHPUT)})")
        if big is not None and big[name].walls:
            sample = big[name]
            per_round = sample.requests // len(sample.walls)
            wall = (
                sum(sample.walls)
                / len(sample.walls)
                / (math.ceil(per_round / 512) * STREAM_SECONDS)
            )
            parts.append(f"; 512 streams {wall:.2f} of ideal ({_met(wall <= LEAN_WALL)})")
        if parts:
            said.append(f"  {name}: {''.join(parts)}")
    if said:
        print(
            f"  (issue 39) whole answers: <= {LEAN_ADDED_MS} ms added at the median and <= "
            f"{LEAN_CPU_MS} ms CPU a request at 1 client, >= {LEAN_THROUGHPUT} of direct at 32 "
            f"clients; 512 streams <= {LEAN_WALL}x ideal"
        )
        print("\n".join(said))


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def verdicts(
    results: dict[tuple[str, int], dict[str, Sample]], levels: list[int], proxies: list[str]
) -> None:
    if "llmgw" not in proxies:
        return
    for mode, (_, stream, _description) in MODES.items():
        if stream or ("before" not in proxies and "traced" not in proxies):
            continue
        for clients in levels:
            cell = results[(mode, clients)]
            now = percentile(cell["llmgw"].totals, 0.5)
            said = [f"  {mode}, {clients} clients: p50 {now * 1000:.3f} ms"]
            if "before" in proxies:
                added = (now - percentile(cell["before"].totals, 0.5)) * 1000
                met = "met" if added <= TARGET_TRACING_OFF_MS else "NOT met"
                said.append(
                    f"tracing off vs before {added:+.3f} ms (<= {TARGET_TRACING_OFF_MS} ms: {met})"
                )
            if "traced" in proxies:
                added = (percentile(cell["traced"].totals, 0.5) - now) * 1000
                cpu = (
                    cell["traced"].cpu / max(1, cell["traced"].requests)
                    - cell["llmgw"].cpu / max(1, cell["llmgw"].requests)
                ) * 1000
                said.append(f"tracing on adds {added:+.3f} ms p50, {cpu:+.3f} ms CPU per request")
            print("; ".join(said))
    big = results.get(("stream 50ms", 512))
    if big is not None:
        gw = big["llmgw"]
        per_round = gw.requests // max(1, len(gw.walls))
        wall = sum(gw.walls) / len(gw.walls) / (math.ceil(per_round / 512) * STREAM_SECONDS)
        print(
            f"  512 streams: wall/ideal {wall:.2f} (<= 1.5: {'met' if wall <= 1.5 else 'NOT met'}), "
            f"{gw.most_open} open at once ({'met' if gw.most_open >= 512 else 'NOT met'}), "
            f"{gw.errors} errors ({'met' if gw.errors == 0 else 'NOT met'})"
        )
    one = results.get(("whole", 1))
    if one is not None:
        added = percentile(one["llmgw"].totals, 0.5) - percentile(one["direct"].totals, 0.5)
        print(
            f"  whole, 1 client: added p50 {added * 1000:.2f} ms ({'met' if added <= 0.001 else 'NOT met'})"
        )
    cpus = [
        results[(mode, c)]["llmgw"].cpu / max(1, results[(mode, c)]["llmgw"].requests) * 1000
        for mode in MODES
        for c in levels
        if mode == "whole"
    ]
    if cpus:
        print(
            f"  whole: CPU per request {min(cpus):.2f}-{max(cpus):.2f} ms ({'met' if max(cpus) <= 1.5 else 'NOT met'} <= 1.5)"
        )
    if "litellm" not in proxies:
        print("  LiteLLM not measured: no comparison")
        return
    behind = []
    broken = [key for key, cell in results.items() if not cell["litellm"].totals]
    if broken:
        print(f"  LiteLLM answered nothing in {len(broken)} cells (see its errors column)")
    for (mode, clients), cell in results.items():
        if (mode, clients) in broken:
            continue
        gw, lt = cell["llmgw"], cell["litellm"]
        checks = {
            "added p50": percentile(gw.totals, 0.5) <= percentile(lt.totals, 0.5),
            "added p99": percentile(gw.totals, 0.99) <= percentile(lt.totals, 0.99),
            "throughput": gw.throughput >= lt.throughput,
            "cpu": gw.cpu / max(1, gw.requests) <= lt.cpu / max(1, lt.requests),
        }
        behind += [f"{mode} at {clients}: {what}" for what, ok in checks.items() if not ok]
    if behind:
        print(
            f"  behind LiteLLM in {len(behind)} of {4 * len(results)} comparisons: "
            + "; ".join(behind)
        )
    else:
        print(
            f"  ahead of LiteLLM in all {4 * len(results)} comparisons (added p50, p99, throughput, CPU per cell)"
        )


async def limits_cost(
    gateways: dict[str, tuple[str, int]], secrets: dict[str, str], quick: bool
) -> tuple[dict[int, dict[str, Sample]], bool]:
    """Whole answers with the unlimited key and the limited one, in interleaved rounds (the
    order swapped every round, so that a drift of the machine's load falls on both), per
    LIMIT_LEVELS clients, through each of `gateways` (its URL and pid, by name: this revision's,
    and with --baseline the one before, on the same database); and whether the limited key's
    answer said where its limits stand (x-ratelimit-* headers: its limits were counted)."""
    import aiohttp

    body = request_body("bench-fast", False)
    keys = {name: {"Authorization": f"Bearer {secrets[key]}"} for name, key in LIMIT_KEYS.items()}
    paths = {
        (gateway, name): (f"{url}/v1/chat/completions", headers, pid)
        for gateway, (url, pid) in gateways.items()
        for name, headers in keys.items()
    }
    results: dict[int, dict[str, Sample]] = {}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout, auto_decompress=False
    ) as session:
        counted = True
        for url, headers, _ in paths.values():
            async with session.post(url, data=body, headers=keys["limited"]) as response:
                await response.read()
                counted = counted and "x-ratelimit-limit-requests" in response.headers
            await run_cell(session, url, headers, body, 8, 64, Sample())  # warm
        for clients in LIMIT_LEVELS:
            rounds = 6 if quick else 12
            per_round = max(clients * 20, 200 if quick else 500)
            cell = {_limits_label(*path): Sample() for path in paths}
            for index in range(rounds):
                for path in list(paths)[:: 1 if index % 2 == 0 else -1]:
                    url, headers, pid = paths[path]
                    sample = cell[_limits_label(*path)]
                    before = tree_cpu_seconds(pid)
                    await run_cell(session, url, headers, body, clients, per_round, sample)
                    sample.cpu += tree_cpu_seconds(pid) - before
            results[clients] = cell
            print(f"  measured limits at {clients} clients", file=sys.stderr, flush=True)
    return results, counted


def _limits_label(gateway: str, key: str) -> str:
    return key if gateway == "llmgw" else f"{gateway}: {key}"


def report_limits(results: dict[int, dict[str, Sample]], counted: bool) -> None:
    ms = lambda s: f"{s * 1000:.3f}"  # noqa: E731
    print(
        f"\nlimits: whole answers through llmgw, a key without limits and one with "
        f"{LIMITED_KEY.replace('=', ' ')}\n  in a team with {LIMITED_TEAM.replace('=', ' ')} "
        "(every limit checked, none reached), in interleaved rounds; 'traced' rows: the gateway "
        "with tracing on,\n  their +p50 counted from llmgw's key without limits (what tracing, "
        "and tracing with limits, add)"
    )
    if not counted:
        print("  the limited key's answers have no x-ratelimit-* headers: were its limits counted?")
    print(
        f"{'clients':>7} {'key':<20}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'errors':>7}"
        f"{'cpu ms/req':>11}{'+p50 ms':>9}  target"
    )
    for clients, cell in results.items():
        for name, sample in cell.items():
            gateway = name.rsplit(": ", 1)[0] if ": " in name else ""
            # Tracing's cost, and tracing's and the limits' together, are counted from the
            # gateway with neither: the rows with both off.
            of = "llmgw" if gateway in ("", "traced") else gateway
            base = percentile(cell[_limits_label(of, "no limits")].totals, 0.5)
            p50 = percentile(sample.totals, 0.5)
            added, target = "-", ""
            if gateway == "traced" or not name.endswith("no limits"):
                added = ms(p50 - base)
                if clients == 1 and gateway != "traced":
                    met = (p50 - base) * 1000 <= TARGET_LIMITS_ADDED_MS
                    target = f"<= {TARGET_LIMITS_ADDED_MS} ms: {'met' if met else 'NOT met'}"
            cpu = sample.cpu / max(1, sample.requests) * 1000
            print(
                f"{clients:>7} {name:<20}{sample.requests:>6}{ms(p50):>9}"
                f"{ms(percentile(sample.totals, 0.99)):>9}{sample.errors:>7}{cpu:>11.3f}"
                f"{added:>9}  {target}"
            )


async def spread(gateway: str, auth: dict[str, str], upstreams: list[str]) -> None:
    """Least-loaded over 2 replicas, with the gateway's 2 workers choosing: neither above 60%."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for upstream in upstreams:
            async with session.get(f"{upstream}/_stats?reset") as response:
                await response.read()
        for clients, count in ((2, 20), (8, 48), (32, 128)):
            sample = Sample()
            body = request_body("bench-pair", True)
            url = f"{gateway}/v1/chat/completions"
            await run_cell(session, url, auth, body, clients, count, sample)
            served = []
            for upstream in upstreams:
                async with session.get(f"{upstream}/_stats?reset") as response:
                    served.append(json.loads(await response.read())["pair_served"])
            share = max(served) / max(1, sum(served)) * 100
            print(
                f"spread over 2 replicas through {WORKERS} gateway workers, {clients} clients, "
                f"{count} 1-s streams: {served[0]} / {served[1]} (busiest {share:.0f}%; "
                f"target <= 60%), {sample.errors} errors"
            )


def start_baseline(processes: Processes, folder: Path, revision: str, env: dict[str, str]) -> str:
    """The gateway of another revision (a git worktree of it), on the same database, as "before".

    Its code is imported from the worktree (uvicorn puts its working folder first on the path);
    it keeps its own var/ and metrics so that nothing it holds is shared with the other gateway.
    """
    from llmgw_site.management.commands.llmgw_run import gateway_command

    tree = folder / "baseline"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), revision],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    port = free_port()
    processes.start(
        "before",
        gateway_command(Path(sys.executable).parent, "127.0.0.1", port, workers=WORKERS),
        {
            **env,
            "PYTHONPATH": str(tree),
            "LLMGW_VAR_DIR": str(folder / "var-before"),
            "LLMGW_METRICS_DIR": str(folder / "metrics-before"),
        },
        cwd=tree,
    )
    return f"http://127.0.0.1:{port}"


def remove_baseline(folder: Path) -> None:
    """Take away the worktree start_baseline made in `folder`."""
    subprocess.run(
        ["git", "worktree", "remove", "--force", str(folder / "baseline")],
        cwd=ROOT,
        capture_output=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer requests per cell (a few minutes)"
    )
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels")
    parser.add_argument("--no-litellm", action="store_true", help="measure without LiteLLM")
    parser.add_argument(
        "--traced",
        action="store_true",
        help="(the default) also run this revision's gateway with tracing on, exporting to an "
        "OTLP receiver (as 'traced'): what tracing costs beside what it costs when off",
    )
    parser.add_argument(
        "--no-traced", action="store_true", help="without the gateway that traces every request"
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also run the gateway of git revision REV (as 'before'), in the same interleaved "
        "rounds: a change's cost measured before and after in one run",
    )
    parser.add_argument(
        "--only-limits",
        action="store_true",
        help="only the limits section (with --baseline, measured on both revisions)",
    )
    args = parser.parse_args()
    args.traced = not args.no_traced
    levels = [int(x) for x in args.levels.split(",")]
    if args.only_limits:
        args.no_litellm = True
    installing = None if args.no_litellm else litellm_install()
    with (
        tempfile.TemporaryDirectory(prefix="llmgw-bench-gw-") as tmp,
        OtlpReceiver() as receiver,
    ):
        folder = Path(tmp)
        processes = Processes(folder)
        try:
            upstream_port, second_port = start_upstreams(processes)
            upstream = f"http://127.0.0.1:{upstream_port}"
            env, secrets = prepare_gateway_keys(folder, upstream_port, second_port)
            key = secrets["bench"]
            from llmgw_site.management.commands.llmgw_run import gateway_command

            gateway_port = free_port()
            processes.start(
                "llmgw",
                gateway_command(
                    Path(sys.executable).parent, "127.0.0.1", gateway_port, workers=WORKERS
                ),
                env,
            )
            gateway = f"http://127.0.0.1:{gateway_port}"
            auth = {"Authorization": f"Bearer {key}"}
            wait_http(f"{gateway}/v1/models", "the gateway", headers=auth)
            paths: dict[str, tuple[str, dict[str, str], int | None]] = {
                "direct": (f"{upstream}/v1/chat/completions", {}, None),
                "llmgw": (f"{gateway}/v1/chat/completions", auth, processes.pid("llmgw")),
            }
            if args.baseline:
                before = start_baseline(processes, folder, args.baseline, env)
                wait_http(f"{before}/v1/models", "the baseline gateway", headers=auth)
                paths["before"] = (
                    f"{before}/v1/chat/completions",
                    auth,
                    processes.pid("before"),
                )
            if args.traced:
                traced_port = free_port()
                processes.start(
                    "traced",
                    gateway_command(
                        Path(sys.executable).parent, "127.0.0.1", traced_port, workers=WORKERS
                    ),
                    {
                        **env,
                        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                        "LLMGW_VAR_DIR": str(folder / "var-traced"),
                        "LLMGW_METRICS_DIR": str(folder / "metrics-traced"),
                    },
                )
                traced = f"http://127.0.0.1:{traced_port}"
                wait_http(f"{traced}/v1/models", "the traced gateway", headers=auth)
                paths["traced"] = (
                    f"{traced}/v1/chat/completions",
                    auth,
                    processes.pid("traced"),
                )
            if not args.no_litellm:
                if installing is not None:
                    try:
                        installing.wait(timeout=LITELLM_INSTALL_SECONDS)
                    except subprocess.TimeoutExpired:
                        os.killpg(installing.pid, signal.SIGKILL)
                if litellm_installed():
                    try:
                        litellm = start_litellm(processes, folder, upstream_port)
                        paths["litellm"] = (
                            f"{litellm}/v1/chat/completions",
                            {"Authorization": f"Bearer {LITELLM_KEY}"},
                            processes.pid("litellm"),
                        )
                    except RuntimeError as exc:
                        print(
                            f"LiteLLM's proxy did not start ({exc}); measuring without it.\n{processes.log_tail('litellm')}"
                        )
                else:
                    print(
                        f"litellm[proxy]=={LITELLM_VERSION} could not be installed into "
                        f"{LITELLM_VENV}; measuring without it."
                    )
            print(
                f"gateway bench{' (quick)' if args.quick else ''}: {', '.join(paths)}"
                f"{f' (LiteLLM {LITELLM_VERSION})' if 'litellm' in paths else ''}; {WORKERS} workers each; "
                f"{os.cpu_count()} cores shared by the upstream, the proxies and the load generator"
            )
            if not args.only_limits:
                results = asyncio.run(measure(paths, upstream, levels, args.quick))
                report(results, levels, list(paths))
            limited = {"llmgw": (gateway, processes.pid("llmgw"))}
            if args.baseline:
                limited["before"] = (paths["before"][0].rsplit("/v1/", 1)[0], paths["before"][2])
            if args.traced:
                limited["traced"] = (paths["traced"][0].rsplit("/v1/", 1)[0], paths["traced"][2])
            report_limits(*asyncio.run(limits_cost(limited, secrets, args.quick)))
            if not args.only_limits:
                asyncio.run(spread(gateway, auth, [upstream, f"http://127.0.0.1:{second_port}"]))
        finally:
            processes.stop_all()
            if args.baseline:
                remove_baseline(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
