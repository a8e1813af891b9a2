"""What the gateway adds: the same requests sent straight to a replica and through the gateway.

It starts a whole llmgw (gunicorn, Celery worker with beat, one node agent) on 127.0.0.1 with
one replica of a tiny generated model, then, at 1, 8 and 32 concurrent clients, sends the
same non-streaming and streaming completions to the replica's engine and to the gateway in
alternating rounds, and prints the latency the gateway adds (median and p99) and the
throughput through the gateway as a share of the direct one. The engine serves one request
at a time, so throughput is the engine's; the ratio shows whether the gateway gets in its way.
Everything it starts is stopped (by pid) when it ends.

Run: make bench (or .venv/bin/python bench/gateway.py [--requests 120] [--clients 1,8,32])
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from tests.support.system import System

MODEL = "bench-tiny"
MAX_TOKENS = 16
ROUNDS = 4  # direct, gateway, direct, gateway, ...: drift on the machine hits both alike
CELL_SECONDS = 60  # a cell (one path, mode and concurrency) stops early past this


@dataclass
class Sample:
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))
    return ordered[index]


def one_request(
    session: requests.Session, url: str, headers: dict[str, str], stream: bool
) -> tuple[float, float]:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": MAX_TOKENS, "stream": stream}
    started = time.perf_counter()
    first = 0.0
    with session.post(url, json=body, headers=headers, stream=True, timeout=120) as response:
        response.raise_for_status()
        for chunk in response.iter_content(chunk_size=None):
            if chunk and not first:
                first = time.perf_counter() - started
    return time.perf_counter() - started, first


def run_cell(
    url: str, headers: dict[str, str], stream: bool, clients: int, count: int, into: Sample
) -> None:
    sessions = threading.local()
    deadline = time.monotonic() + CELL_SECONDS
    lock = threading.Lock()

    def work(_: int) -> None:
        if time.monotonic() > deadline:
            return
        session = getattr(sessions, "session", None)
        if session is None:
            session = sessions.session = requests.Session()
            session.trust_env = False
        try:
            latency, first = one_request(session, url, headers, stream)
        except requests.RequestException:
            with lock:
                into.errors += 1
            return
        with lock:
            into.latencies.append(latency)
            into.first_bytes.append(first)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(work, range(count)))
    into.seconds += time.perf_counter() - started


def web_cpu_seconds(system: System) -> float:
    """CPU time used so far by the web process (gunicorn's master and its workers)."""
    master = system.processes["web"].pid
    pids = [master]
    try:
        pids += [int(p) for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()]
    except OSError:
        return float("nan")
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return total


def start_system(folder: Path, weights_url: str) -> tuple[System, str, str]:
    """The running system, the replica's engine URL and a gateway key."""
    from tests.support.system import System, wait_for

    system = System(folder, allowed_hosts=[urlsplit(weights_url).netloc])
    system.env["LLMGW_METRICS_DIR"] = str(folder / "metrics")
    system.start()
    system.add_node("bench-node", memory_gb=4, cores=2)
    system.api(
        "POST",
        "models",
        json={
            "name": MODEL,
            "source": f"{weights_url}/tiny.gguf",
            "context_length": 512,
            "profiles": [{"name": "cpu", "memory_gb": 1, "cores": 1}],
        },
    )

    def ready_port() -> int | None:
        replicas = system.api("GET", f"models/{MODEL}/target")["replicas"]
        return next((r["port"] for r in replicas if r["routable"]), None)

    port = wait_for(ready_port, timeout=120, what="the replica to be ready")
    key = system.api("POST", "keys", json={"name": "bench"})["key"]
    return system, f"http://127.0.0.1:{port}", key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=160, help="per path, mode and concurrency")
    parser.add_argument("--clients", default="1,8,32")
    args = parser.parse_args()
    if importlib.util.find_spec("llama_cpp") is None:
        print("gateway bench: skipped, llama-cpp-python is not installed")
        return 0
    levels = [int(c) for c in args.clients.split(",")]

    from llmgw.tinygguf import write_tiny_model
    from tests.support.http_files import serve_directory

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-gw-") as tmp:
        folder = Path(tmp)
        (folder / "weights").mkdir()
        write_tiny_model(folder / "weights" / "tiny.gguf", seed=1)
        with serve_directory(folder / "weights") as (weights_url, _stats):
            system: System | None = None
            try:
                system, engine_url, key = start_system(folder / "system", weights_url)
                report(system, engine_url, key, levels, args.requests)
            finally:
                if system is not None:
                    system.close()
    return 0


def report(system: System, engine_url: str, key: str, levels: list[int], count: int) -> None:
    gateway_url = system.url
    paths: dict[str, tuple[str, dict[str, str]]] = {
        "direct": (f"{engine_url}/v1/completions", {}),
        "gateway": (f"{gateway_url}/v1/completions", {"Authorization": f"Bearer {key}"}),
    }
    # Warm both paths (connections, the catalog copy in each web worker).
    for url, headers in paths.values():
        for stream in (False, True):
            run_cell(url, headers, stream, 4, 16, Sample())

    print(
        f"gateway: a {MAX_TOKENS}-token completion of a tiny model, {count} requests per cell, "
        "straight to the replica vs through the gateway"
    )
    header = (
        f"{'mode':<10}{'clients':>8}{'direct p50':>12}{'gw p50':>10}{'added p50':>11}"
        f"{'direct p99':>12}{'gw p99':>10}{'added p99':>11}{'added 1st':>11}{'direct/s':>10}{'gw/s':>8}{'gw/direct':>10}{'web cpu':>9}{'errors':>8}"
    )
    print(header)
    for stream in (False, True):
        for clients in levels:
            samples = {name: Sample() for name in paths}
            web_cpu = 0.0
            for _ in range(ROUNDS):
                for name, (url, headers) in paths.items():
                    before = web_cpu_seconds(system)
                    run_cell(url, headers, stream, clients, count // ROUNDS, samples[name])
                    if name == "gateway":
                        web_cpu += web_cpu_seconds(system) - before
            direct, gateway = samples["direct"], samples["gateway"]
            cpu_ms = web_cpu / max(1, len(gateway.latencies)) * 1000
            print(_row("stream" if stream else "whole", clients, direct, gateway, cpu_ms))
    print(
        "Latencies in ms to the last byte; 'added' is gateway minus direct at the same percentile;\n"
        "'added 1st' is the same for the median time to the first byte (a stream's first event);\n"
        "gw/direct is requests per second through the gateway over straight to the replica;\n"
        "web cpu is the web processes' CPU time per request through the gateway, in ms. On a small\n"
        "machine that CPU is taken from the engine, which is why throughput drops under load."
    )


def _row(mode: str, clients: int, direct: Sample, gateway: Sample, cpu_ms: float) -> str:
    ms: Callable[[float], str] = lambda s: f"{s * 1000:.1f}"  # noqa: E731
    d50, g50 = statistics.median(direct.latencies), statistics.median(gateway.latencies)
    d99, g99 = percentile(direct.latencies, 0.99), percentile(gateway.latencies, 0.99)
    first = statistics.median(gateway.first_bytes) - statistics.median(direct.first_bytes)
    ratio = gateway.throughput / direct.throughput if direct.throughput else float("nan")
    return (
        f"{mode:<10}{clients:>8}{ms(d50):>12}{ms(g50):>10}{ms(g50 - d50):>11}"
        f"{ms(d99):>12}{ms(g99):>10}{ms(g99 - d99):>11}{ms(first):>11}{direct.throughput:>10.1f}"
        f"{gateway.throughput:>8.1f}{ratio:>10.2f}{cpu_ms:>9.1f}{direct.errors + gateway.errors:>8}"
    )


if __name__ == "__main__":
    sys.exit(main())
