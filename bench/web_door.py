"""The web's door under slow uploads: the gateway and the web process as the run command starts
them (two gateway workers, gunicorn behind), while ATTACKERS anonymous connections each declare
a 1 MiB body to POST /login/ and trickle it (16 bytes at once, then a byte a second), how
logins, API writes and nodes' reports are answered: their statuses and latency p50, p99 and max.

The slow uploads are kept by their pause limit and deadline alone (LLMGW_GATEWAY_BODY_MIN_RATE=0),
so that every one stays while the requests are timed; the minimum rate would cut them off after
5 s. Run the same file from a checkout of the code before the change to compare (it starts the
processes of the tree it is in).

Run: .venv/bin/python bench/web_door.py [--attackers 0,200,1000] [--requests 20]
(DATABASE_URL: PostgreSQL as the tests use it, or unset for SQLite)
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import percentile  # noqa: E402
from tests.support.system import System  # noqa: E402

DECLARED = 1024 * 1024
FIRST_PIECE = 16


class SlowUploads:
    """`count` connections trickling their bodies from a thread of their own, until stopped;
    `answered`: how many the gateway answered or closed meanwhile."""

    def __init__(self, url: str, count: int) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.address = (host, int(port))
        self.count = count
        self.answered = 0
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        await asyncio.gather(*(self._one() for _ in range(self.count)))

    async def _one(self) -> None:
        reader, writer = await asyncio.open_connection(*self.address)
        writer.write(
            f"POST /login/ HTTP/1.1\r\nHost: {self.address[0]}\r\n"
            f"Content-Type: application/x-www-form-urlencoded\r\n"
            f"Content-Length: {DECLARED}\r\n\r\n".encode()
            + b"a" * FIRST_PIECE
        )
        self.opened += 1
        try:
            while not self._stop.is_set():
                try:
                    await asyncio.wait_for(reader.read(1), 1)
                except TimeoutError:
                    writer.write(b"a")
                    continue
                self.answered += 1
                return
        finally:
            writer.close()

    def wait_opened(self) -> None:
        deadline = time.monotonic() + 60
        while self.opened < self.count and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def timed(call: object, *args: object, **kwargs: object) -> tuple[int, float]:
    started = time.monotonic()
    try:
        status = call(*args, **kwargs).status_code  # type: ignore[operator]
    except requests.RequestException:
        status = 0
    return status, time.monotonic() - started


def measure(system: System, node_token: str, attackers: int, count: int, round_: int) -> None:
    uploads = SlowUploads(system.url, attackers) if attackers else None
    if uploads is not None:
        uploads.wait_opened()
        time.sleep(1)  # the gateway reads what they sent
    results: dict[str, list[tuple[int, float]]] = {"login": [], "api write": [], "report": []}
    try:
        for index in range(count):
            people = requests.Session()
            page = people.get(f"{system.url}/login/", timeout=30).text
            csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
            form = {
                "username": "admin",
                "password": system.admin_password,
                "csrfmiddlewaretoken": csrf[1] if csrf else "",
            }
            results["login"].append(
                timed(
                    people.post,
                    f"{system.url}/login/",
                    data=form,
                    allow_redirects=False,
                    timeout=30,
                )
            )
            results["api write"].append(
                timed(
                    requests.post,
                    f"{system.url}/api/v1/nodes",
                    json={"name": f"bench-{attackers}-{round_}-{index}"},
                    headers=system.headers,
                    timeout=30,
                )
            )
            results["report"].append(
                timed(
                    requests.post,
                    f"{system.url}/api/v1/node/heartbeat",
                    json={"capacity": {"memory_gb": 4, "cores": 4}},
                    headers={"Authorization": f"Bearer {node_token}"},
                    timeout=30,
                )
            )
    finally:
        if uploads is not None:
            uploads.stop()
    held = f", slow uploads answered or closed meanwhile: {uploads.answered}" if uploads else ""
    print(f"{attackers} slow uploads{held}")
    for kind, figures in results.items():
        seconds = [took * 1000 for _, took in figures]
        statuses = Counter(status for status, _ in figures)
        print(
            f"  {kind:9} statuses {dict(sorted(statuses.items()))}  p50 "
            f"{percentile(seconds, 0.5):.0f} ms  p99 {percentile(seconds, 0.99):.0f} ms  "
            f"max {max(seconds):.0f} ms"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attackers", default="0,200,1000")
    parser.add_argument("--requests", type=int, default=20)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-web-door-") as folder:
        system = System(Path(folder) / "system")
        system.env["LLMGW_GATEWAY_BODY_MIN_RATE"] = "0"
        try:
            system.start(worker=False)
            node_token = system.add_node("bench-node", memory_gb=4, cores=4, start=False)
            for round_, attackers in enumerate(int(n) for n in options.attackers.split(",")):
                measure(system, node_token, attackers, options.requests, round_)
        finally:
            system.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
