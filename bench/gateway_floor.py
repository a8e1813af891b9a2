"""What the gateway's features cost over the layers they run on: whole answers at 1 and 32
clients, in interleaved rounds, on three paths to the fast fake upstream (bench/fake_upstream.py):

- direct: straight to the upstream (a raw ASGI application under uvicorn: a Python server's
  least);
- floor: uvicorn with the gateway's protocol (gateway.protocol.GatewayProtocol) and an
  application that reads the body and relays it through the gateway's engine pool
  (gateway.upstream), and nothing else: no key, no validation, no routing, no queue, no
  metrics. What any gateway built on these layers pays before its first feature;
- llmgw: the gateway as the run command starts it.

One worker process each, so that the CPU per request is one process's (the scheduler's
counters), beside issue 39's targets for the gateway: <= 0.3 ms of CPU a request and <= 0.5 ms
added at the median at one client. `features` is llmgw less floor.

`sleeps/req` is how often a request put the process to sleep (its voluntary context switches: at
1 client a proxy waits twice a request, for the client and for the upstream; at 32 the work of
one wake serves many). Waking is not free, and on a virtual machine it can be dear: the bench
also prints what one wake from a short sleep costs this machine in CPU, measured in its own
process, which is what a request at 1 client pays twice in every process it passes, whatever the
code does.

    .venv/bin/python bench/gateway_floor.py [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import (  # noqa: E402
    Processes,
    Sample,
    free_port,
    percentile,
    prepare_gateway_keys,
    request_body,
    run_cell,
    start_upstreams,
    tree_cpu_seconds,
    wait_http,
)

TARGET_CPU_MS, TARGET_ADDED_MS = 0.3, 0.5
LEVELS = (1, 32)

# The floor's application: uvicorn imports it by name (FLOOR_APP), so it is written to a file.
FLOOR_APP = """
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
django.setup()

from gateway import http, upstream  # noqa: E402

PORT = int(os.environ["LLMGW_BENCH_FLOOR_UPSTREAM"])
pool = None


async def application(scope, receive, send):
    global pool
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            kind = message["type"].rsplit(".", 1)[1]
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return
    if pool is None:
        pool = upstream.Pool()
    raw = await http.read_body(receive, 1 << 20)
    connection = await pool.connection("127.0.0.1", PORT)
    connection.write(
        upstream.request_head("POST", "127.0.0.1", PORT, scope["path"], {}, len(raw)), raw
    )
    await connection.head(60)
    body = await connection.whole(60)
    status = connection.status
    connection.done()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})
"""


async def measure(
    paths: dict[str, tuple[str, dict[str, str], int]], seconds: float, rounds: int
) -> dict[int, dict[str, tuple[Sample, float, int]]]:
    import aiohttp

    body = request_body("bench-fast", False)
    found: dict[int, dict[str, tuple[Sample, float, int]]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url, headers, _ in paths.values():  # warm: connections, first requests
            await run_cell(session, url, headers, body, 8, 200, Sample())
        for clients in LEVELS:
            cell = {name: (Sample(), 0.0, 0) for name in paths}
            for _ in range(rounds):
                for name, (url, headers, pid) in paths.items():
                    sample, cpu, slept = cell[name]
                    before, switches = tree_cpu_seconds(pid), sleeps(pid)
                    until = time.monotonic() + seconds
                    while time.monotonic() < until:
                        await run_cell(session, url, headers, body, clients, clients * 20, sample)
                    cell[name] = (
                        sample,
                        cpu + tree_cpu_seconds(pid) - before,
                        slept + sleeps(pid) - switches,
                    )
            found[clients] = cell
            print(f"  measured {clients} clients", file=sys.stderr, flush=True)
    return found


def sleeps(pid: int) -> int:
    """How often the process's threads have given up the CPU to wait, so far (voluntary
    context switches)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def wake_cost_us(pause: float = 0.0005, times: int = 400) -> float:
    """The CPU one wake from a `pause`-second sleep costs this machine, in microseconds (this
    process's own, measured over `times` sleeps)."""
    started = time.process_time()
    for _ in range(times):
        time.sleep(pause)
    return (time.process_time() - started) / times * 1e6


def report(found: dict[int, dict[str, tuple[Sample, float, int]]]) -> None:
    print(
        f"{'clients':>7} {'path':<9}{'n':>7}{'p50 ms':>9}{'+p50 ms':>9}{'cpu ms/req':>11}"
        f"{'sleeps/req':>11}"
    )
    for clients, cell in found.items():
        direct = percentile(cell["direct"][0].totals, 0.5)
        cpu = {}
        for name, (sample, seconds, slept) in cell.items():
            p50 = percentile(sample.totals, 0.5)
            cpu[name] = seconds / max(1, len(sample.totals)) * 1000
            added = "-" if name == "direct" else f"{(p50 - direct) * 1000:.3f}"
            print(
                f"{clients:>7} {name:<9}{len(sample.totals):>7}{p50 * 1000:>9.3f}{added:>9}"
                f"{cpu[name]:>11.3f}{slept / max(1, len(sample.totals)):>11.2f}"
            )
        features = cpu["llmgw"] - cpu["floor"]
        print(f"{clients:>7} {'features':<9}{'':>7}{'':>9}{'':>9}{features:>11.3f}")
    one = found[1]
    direct = percentile(one["direct"][0].totals, 0.5)
    for name in ("floor", "llmgw"):
        sample, seconds, _ = one[name]
        cpu = seconds / max(1, len(sample.totals)) * 1000
        added = (percentile(sample.totals, 0.5) - direct) * 1000
        print(
            f"  {name} at 1 client: {cpu:.3f} ms CPU (<= {TARGET_CPU_MS}: "
            f"{'met' if cpu <= TARGET_CPU_MS else 'NOT met'}), +{added:.3f} ms p50 "
            f"(<= {TARGET_ADDED_MS}: {'met' if added <= TARGET_ADDED_MS else 'NOT met'})"
        )
    wake = wake_cost_us()
    print(
        f"  this machine: one wake from a 0.5 ms sleep costs {wake:.0f} us of CPU; at 1 client "
        f"each path's process sleeps and wakes the times per request in sleeps/req"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per path, per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from llmgw_site.management.commands.llmgw_run import gateway_command

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-floor-") as tmp:
        folder = Path(tmp)
        (folder / "llmgw_bench_floor.py").write_text(FLOOR_APP)
        processes = Processes(folder)
        try:
            upstream_port, second_port = start_upstreams(processes)
            env, secrets = prepare_gateway_keys(folder, upstream_port, second_port)
            env["LLMGW_BENCH_FLOOR_UPSTREAM"] = str(upstream_port)
            env["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT)])
            auth = {"Authorization": f"Bearer {secrets['bench']}"}
            upstream = f"http://127.0.0.1:{upstream_port}"
            paths = {"direct": (f"{upstream}/v1/chat/completions", {}, processes.pid("upstream"))}
            for name, app in (("floor", "llmgw_bench_floor:application"), ("llmgw", None)):
                port = free_port()
                command = gateway_command(Path(sys.executable).parent, "127.0.0.1", port, workers=1)
                if app is not None:
                    command[1] = app
                processes.start(name, command, env)
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                models = f"http://127.0.0.1:{port}/v1/models"
                wait_http(models if app is None else f"{upstream}/health", name, headers=auth)
                paths[name] = (url, auth if app is None else {}, processes.pid(name))
            # The floor answers once uvicorn listens: wait for its first answer.
            try:
                asyncio.run(_first_answer(paths["floor"][0]))
            except RuntimeError:
                print(processes.log_tail("floor"), file=sys.stderr)
                raise
            print(
                f"gateway floor bench: whole answers, {args.rounds} interleaved rounds of "
                f"{args.seconds:g} s per path; one worker process each; {os.cpu_count()} cores"
            )
            report(asyncio.run(measure(paths, args.seconds, args.rounds)))
        finally:
            processes.stop_all()
    return 0


async def _first_answer(url: str) -> None:
    import aiohttp

    body = request_body("bench-fast", False)
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            try:
                async with session.post(url, data=body) as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the floor at {url} did not answer")


if __name__ == "__main__":
    sys.exit(main())
