"""What an anonymous client can cost the gateway before it is known: llmgw's gateway as the run
command starts it (gateway.protocol: heads bounded in size, count and time) beside the same
application on stock uvicorn with httptools (what the gateway ran on before, and what a plain
uvicorn deployment runs), in alternating rounds, one worker each, on one database.

1. One client sends a header without end (8 KiB writes, as fast as the socket takes them; at
   most 16 MiB): when it is cut off, how many bytes were taken, and the gateway's CPU time.
2. ATTACKERS such clients at once (8 KiB every 50 ms each), each starting again when cut off
   (at most 256 KiB per connection, so stock uvicorn's memory stays within this machine), while
   one ordinary client in a process of its own asks GET /v1/models with its key, one request
   after another: its latency p50 and p99 and errors, beside the same client with no attackers.

Targets (issue 19): one endless head cut off within 1 s at under 50 ms of CPU; with 1,000 such
clients, other clients' p99 under 50 ms.

Run: make bench, or .venv/bin/python bench/front_door.py [--attackers 1000] [--seconds 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import (  # noqa: E402
    Processes,
    free_port,
    percentile,
    prepare_gateway,
    tree_cpu_seconds,
    wait_http,
)

CHUNK = b"a" * 8192
ONE_CLIENT_CAP = 16 * 1024 * 1024
ATTACKER_CAP = 256 * 1024
# Each of the many attackers writes 8 KiB every 50 ms (160 KiB/s; 160 MB/s for 1,000 of them):
# the load generator shares the 2 cores with the gateway, and must not starve it by itself.
PACE = 0.05
TARGETS = (
    "targets (issue 19): one endless head cut off within 1 s at < 50 ms CPU; "
    "1,000 such clients: others' p99 < 50 ms"
)


async def endless_head(port: int, cap: int, pace: float = 0) -> tuple[int, float, bool]:
    """Send one header's value until the server closes or `cap` bytes went; (bytes sent,
    seconds, whether the server cut it off)."""
    started = time.monotonic()
    sent = 0
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0, 0.0, True
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        while sent < cap:
            writer.write(CHUNK)
            await writer.drain()
            sent += len(CHUNK)
            if pace:
                await asyncio.sleep(pace)
            if reader.at_eof():
                return sent, time.monotonic() - started, True
        return sent, time.monotonic() - started, False
    except (ConnectionError, OSError):
        return sent, time.monotonic() - started, True
    finally:
        writer.close()


async def attacker(port: int, until: float) -> int:
    """Endless heads one after another until `until`; how many connections it made."""
    made = 0
    while time.monotonic() < until:
        await endless_head(port, ATTACKER_CAP, PACE)
        made += 1
        await asyncio.sleep(0)
    return made


async def ordinary(port: int, key: str, until: float) -> tuple[list[float], int]:
    """GET /v1/models one after another on a kept-alive connection; latencies and errors."""
    request = (
        f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n"
    ).encode()
    latencies: list[float] = []
    errors = 0
    reader = writer = None
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert reader is not None
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await asyncio.wait_for(reader.readexactly(length), 10)
            if not head.startswith(b"HTTP/1.1 200"):
                errors += 1
            latencies.append(time.monotonic() - started)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            errors += 1
            if writer is not None:
                writer.close()
            reader = writer = None
        await asyncio.sleep(0.005)
    if writer is not None:
        writer.close()
    return latencies, errors


def ordinary_process(port: int, key: str, seconds: float) -> tuple[list[float], int]:
    return asyncio.run(ordinary(port, key, time.monotonic() + seconds))


async def under_attack(
    port: int, key: str, attackers: int, seconds: float, pool: ProcessPoolExecutor
) -> tuple[list[float], int, int]:
    """The attackers in this process, the ordinary client in another (its latency must not be
    this event loop's)."""
    until = time.monotonic() + seconds
    measured = asyncio.get_running_loop().run_in_executor(
        pool, ordinary_process, port, key, seconds
    )
    made = await asyncio.gather(*(attacker(port, until) for _ in range(attackers)))
    latencies, errors = await measured
    return latencies, errors, sum(made)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attackers", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-door-") as tmp:
        folder = Path(tmp)
        processes = Processes(folder)
        pool = ProcessPoolExecutor(1)
        try:
            upstream_port = free_port()
            processes.start(
                "upstream",
                [sys.executable, str(ROOT / "bench" / "fake_upstream.py"), str(upstream_port)],
            )
            wait_http(f"http://127.0.0.1:{upstream_port}/health", "the fake upstream")
            env, key = prepare_gateway(folder, upstream_port, upstream_port)
            from llmgw_site.management.commands.llmgw_run import gateway_command

            bin_dir = Path(sys.executable).parent
            ports = {"llmgw": free_port(), "stock uvicorn": free_port()}
            ours = gateway_command(bin_dir, "127.0.0.1", ports["llmgw"], workers=1)
            stock = gateway_command(bin_dir, "127.0.0.1", ports["stock uvicorn"], workers=1)
            stock[stock.index("gateway.protocol:GatewayProtocol")] = "httptools"
            processes.start("llmgw", ours, env)
            processes.start("stock uvicorn", stock, env)
            for name, port in ports.items():
                wait_http(
                    f"http://127.0.0.1:{port}/v1/models",
                    name,
                    headers={"Authorization": f"Bearer {key}"},
                )
            print(
                f"front door bench: {args.rounds} alternating rounds, 1 worker each, "
                f"{args.attackers} attackers for {args.seconds:g} s a round"
            )
            print(TARGETS)
            one: dict[str, list[tuple[int, float, bool, float]]] = {n: [] for n in ports}
            crowd: dict[str, list[tuple[list[float], int, int]]] = {n: [] for n in ports}
            quiet: dict[str, list[float]] = {n: [] for n in ports}
            for _ in range(args.rounds):
                for name, port in ports.items():
                    pid = processes.pid(name)
                    cpu = tree_cpu_seconds(pid)
                    sent, seconds, cut = asyncio.run(endless_head(port, ONE_CLIENT_CAP))
                    time.sleep(0.2)  # what it parses after the client stops counts too
                    one[name].append((sent, seconds, cut, tree_cpu_seconds(pid) - cpu))
                    latencies, _ = pool.submit(ordinary_process, port, key, 1).result()
                    quiet[name] += latencies
                    crowd[name].append(
                        asyncio.run(under_attack(port, key, args.attackers, args.seconds, pool))
                    )
                    time.sleep(1)
            print("\n1. one client sending a header without end (each round)")
            for name, rounds in one.items():
                for sent, seconds, cut, cpu in rounds:
                    verdict = (
                        f"cut off after {seconds * 1000:.0f} ms"
                        if cut
                        else f"never cut off ({seconds:.2f} s, stopped by the client)"
                    )
                    print(
                        f"  {name:14} {verdict}, {sent / 1024:,.0f} KiB written before the "
                        f"close reached the client, {cpu * 1000:.0f} ms CPU in the gateway "
                        "(counted in 10 ms ticks)"
                    )
            print(f"\n2. {args.attackers} such clients at once, and one ordinary client")
            for name in ports:
                calm = quiet[name]
                print(
                    f"  {name:14} no attackers:   p50 {percentile(calm, 0.5) * 1000:6.2f} ms  "
                    f"p99 {percentile(calm, 0.99) * 1000:6.2f} ms  ({len(calm)} requests)"
                )
                latencies = [x for lat, _, _ in crowd[name] for x in lat]
                errors = sum(e for _, e, _ in crowd[name])
                connections = sum(c for _, _, c in crowd[name])
                if latencies:
                    figures = (
                        f"p50 {percentile(latencies, 0.5) * 1000:6.2f} ms  "
                        f"p99 {percentile(latencies, 0.99) * 1000:6.2f} ms"
                    )
                else:
                    figures = "no answer at all"
                print(
                    f"  {name:14} under attack:  {figures}  ({len(latencies)} answered, "
                    f"{errors} errors; {connections:,} attacking connections)"
                )
        finally:
            pool.shutdown()
            processes.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
