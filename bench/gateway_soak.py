"""A soak of the gateway: many concurrent streams for minutes, through rolling restarts of real replicas.

It starts a whole llmgw (gateway with 2 workers, web, Celery worker with beat, one node agent) on
127.0.0.1 with 2 replicas of a tiny generated model on the real engine, then keeps STREAMS
concurrent streamed chat completions going for --minutes while it restarts the model's replicas
one at a time (`POST /api/v1/models/NAME/restart`) again and again. It prints the requests that
succeeded and failed (a failure is anything but a 200 stream that ends with [DONE]), the restarts
done, and the gateway processes' memory (RSS) after the first minute and at the end.

Targets (issue 10): 0 failed requests, RSS growth < 10%.

With REDIS_URL set the system uses Redis as its broker; without it, the embedded filesystem broker,
whose worker was seen to die on a half-written message file under this load (kombu's filesystem
transport), which stops the reconciler and so the restarts.

Run: .venv/bin/python bench/gateway_soak.py [--minutes 10] [--streams 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "soak-tiny"


def rss_kb(pid: int) -> int:
    """Resident memory of a process and its descendants, in kB."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return total


async def load(
    url: str,
    key: str,
    streams: int,
    stop: threading.Event,
    outcomes: Counter[str],
    errors: list[str],
) -> None:
    import aiohttp

    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 16,
            "stream": True,
        }
    ).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    ) as session:

        async def client() -> None:
            while not stop.is_set():
                try:
                    async with session.post(
                        f"{url}/v1/chat/completions", data=body, headers=headers
                    ) as response:
                        text = await response.read()
                        if response.status != 200 or not text.rstrip().endswith(b"data: [DONE]"):
                            outcomes["failed"] += 1
                            errors.append(f"{response.status}: {text[-300:]!r}")
                            continue
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    outcomes["failed"] += 1
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                outcomes["ok"] += 1

        await asyncio.gather(*(client() for _ in range(streams)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--streams", type=int, default=128)
    args = parser.parse_args()

    from llmgw.tinygguf import write_tiny_model
    from tests.support.http_files import serve_directory
    from tests.support.system import System, wait_for

    with tempfile.TemporaryDirectory(prefix="llmgw-soak-") as tmp:
        folder = Path(tmp)
        (folder / "weights").mkdir()
        write_tiny_model(folder / "weights" / "tiny.gguf", seed=1)
        with serve_directory(folder / "weights") as (weights_url, _stats):
            system = System(folder / "system", allowed_hosts=[urlsplit(weights_url).netloc])
            try:
                system.start()
                system.add_node("soak-node", memory_gb=4, cores=2)
                system.api(
                    "POST",
                    "models",
                    json={
                        "name": MODEL,
                        "source": f"{weights_url}/tiny.gguf",
                        "context_length": 256,
                        "min_replicas": 2,
                        "profiles": [{"name": "cpu", "memory_gb": 1, "cores": 1}],
                    },
                )

                def ready() -> bool:
                    replicas = system.api("GET", f"models/{MODEL}/target")["replicas"]
                    return len([r for r in replicas if r["routable"]]) == 2

                wait_for(ready, timeout=180, what="2 ready replicas")
                key = system.api("POST", "keys", json={"name": "soak"})["key"]
                return soak(system, key, args.minutes, args.streams, ready, wait_for)
            except BaseException:
                print(system.log_tail())
                raise
            finally:
                system.close()


def soak(system: Any, key: str, minutes: float, streams: int, ready: Any, wait_for: Any) -> int:
    outcomes: Counter[str] = Counter()
    errors: list[str] = []
    stop = threading.Event()
    runner = threading.Thread(
        target=lambda: asyncio.run(load(system.url, key, streams, stop, outcomes, errors)),
        daemon=True,
    )
    gateway_pid = system.processes["gateway"].pid
    started = time.monotonic()
    runner.start()
    restarts = 0
    rss_first = 0
    shown = 0
    try:
        while time.monotonic() - started < minutes * 60:
            if not rss_first and time.monotonic() - started >= min(60, minutes * 30):
                rss_first = rss_kb(gateway_pid)
            time.sleep(15)
            if time.monotonic() - started >= minutes * 60 - 60:
                continue  # no restart in the last minute: let the last one finish
            before = {r["id"] for r in system.api("GET", f"models/{MODEL}/target")["replicas"]}
            system.api("POST", f"models/{MODEL}/restart")

            def replaced(before: set[str] = before) -> bool:
                replicas = system.api("GET", f"models/{MODEL}/target")["replicas"]
                fresh = [r for r in replicas if r["routable"] and r["id"] not in before]
                return len(fresh) == 2

            wait_for(replaced, timeout=240, interval=1, what="the rolling restart")
            restarts += 1
            print(
                f"  {time.monotonic() - started:5.0f}s restart {restarts} done; {dict(outcomes)}; "
                f"gateway RSS {rss_kb(gateway_pid) / 1024:.1f} MB",
                flush=True,
            )
            for error in errors[shown : shown + 3]:
                print(f"    failure: {error}", flush=True)
            shown = len(errors)
    finally:
        stop.set()
        runner.join(timeout=120)
        report(minutes, streams, restarts, outcomes, errors, rss_first, rss_kb(gateway_pid))
    return 0


def report(
    minutes: float,
    streams: int,
    restarts: int,
    outcomes: Counter[str],
    errors: list[str],
    rss_first: int,
    rss_last: int,
) -> None:
    growth = (rss_last - rss_first) / rss_first * 100 if rss_first else float("nan")
    print(
        f"gateway soak: {minutes:g} min, {streams} concurrent streams, {restarts} rolling restarts of "
        f"2 replicas: {outcomes['ok']} ok, {outcomes['failed']} failed; gateway RSS "
        f"{rss_first / 1024:.1f} MB after the first minute, {rss_last / 1024:.1f} MB at the end "
        f"({growth:+.1f}%)"
    )
    print("targets (issue 10): 0 failed requests, RSS growth < 10%")
    for error in errors[:5]:
        print(f"  failure: {error}")


if __name__ == "__main__":
    sys.exit(main())
