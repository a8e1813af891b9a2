"""What the gateway's access log (gateway.accesslog) costs a request, against its target of at most
0.02 ms a request.

1. `record` alone, as gateway.relay._count calls it on the event loop, with the writer thread
   running (so it competes for the GIL as in a worker): the best of ROUNDS rounds of CALLS calls.
2. The writer's own work per line (key names cached): formatting and appending a batch, which
   takes the GIL from the event loop a few times a second, in text and in json.
3. The whole request path in one process: GET /v1/models with a key, through the gateway's ASGI
   application (key check, the answer, the counting), the access log off and on in interleaved
   rounds; the median per request of each and the difference (which the run-to-run noise of a
   path about a thousand times longer than `record` may hide: part 1 is the figure to judge).

Run: .venv/bin/python bench/access_log.py [--calls 200000] [--requests 5000] [--rounds 5]
(about 20 s; on SQLite in a temporary folder unless DATABASE_URL is set).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._django import setup  # noqa: E402

TARGET_MS = 0.02


def time_record(access: Any, calls: int, rounds: int) -> float:
    """Microseconds per record() call: the best of `rounds`."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for number in range(calls):
            access.record(
                request_id="3f1c9e0a2b7d4c5e8f9a0b1c2d3e4f5a",
                key_id=number & 63,
                model="chat",
                endpoint="chat",
                status=200,
                prompt=31,
                completion=5,
                queued=0.0,
                seconds=0.0123,
            )
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def time_writer(folder: Path, form: str, lines: int) -> float:
    """Microseconds of the writer per line, for batches of `lines` lines, key names cached."""
    from gateway.accesslog import AccessLog

    access = AccessLog(
        folder / f"writer-{form}.log",
        form=form,
        names=lambda ids: {key_id: f"app {key_id}" for key_id in ids},
        max_pending=lines,
    )
    time_record(access, lines, 1)
    access.write_pending()  # the names looked up, the file opened
    spent = []
    for _ in range(3):
        time_record(access, lines, 1)
        started = time.perf_counter()
        access.write_pending()
        spent.append((time.perf_counter() - started) / lines * 1e6)
    access.close()
    return min(spent)


def whole_path(requests: int, rounds: int, folder: Path) -> tuple[float, float, int]:
    """Median microseconds a /v1/models request takes through the application, without and with
    the access log, and the lines it wrote."""
    from django.contrib.auth import get_user_model
    from django.db import connection

    from access.services import key_create
    from core.actor import Actor
    from gateway.accesslog import AccessLog
    from gateway.app import Application
    from gateway.metrics import metrics
    from gateway.process import Gateway

    user = get_user_model().objects.create_user("bench-access-log", password="bench-password-1")
    secret = key_create(actor=Actor.for_user(user, "api"), name="bench")[1]
    gateway = Gateway()
    gateway.state.reload()
    connection.close()
    application = Application()
    application.gateway = gateway
    access = AccessLog(folder / "gateway-access.log", board=metrics())
    access.start()
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/models",
        "raw_path": b"/v1/models",
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {secret}".encode()), (b"host", b"bench")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "scheme": "http",
        "http_version": "1.1",
    }
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def one_round(log: AccessLog | None) -> list[float]:
        gateway.access_log = log
        spent = []
        for _ in range(requests):
            started = time.perf_counter()
            await application(scope, receive, send)
            spent.append(time.perf_counter() - started)
        return spent

    async def interleaved() -> tuple[list[float], list[float]]:
        await one_round(None)  # warm up
        off: list[float] = []
        on: list[float] = []
        for _ in range(rounds):
            off += await one_round(None)
            on += await one_round(access)
        return off, on

    off, on = asyncio.run(interleaved())
    access.close()
    assert set(statuses) == {200}, set(statuses)
    return statistics.median(off) * 1e6, statistics.median(on) * 1e6, access.written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--requests", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    setup()
    from gateway.accesslog import AccessLog

    folder = Path(tempfile.mkdtemp(prefix="llmgw-bench-access-log-"))
    access = AccessLog(folder / "record.log", names=lambda ids: {}, max_pending=options.calls)
    access.start()
    record_us = time_record(access, options.calls, options.rounds)
    access.close()
    print(f"Access log, what it costs a request (target: at most {TARGET_MS} ms a request)")
    verdict = "met" if record_us / 1000 <= TARGET_MS else "NOT met"
    print(
        f"  record() on the event loop:   {record_us:.3f} µs a request = "
        f"{record_us / 1000:.5f} ms (target ≤ {TARGET_MS} ms: {verdict}; best of "
        f"{options.rounds} rounds of {options.calls:,})"
    )
    for form in ("text", "json"):
        writer_us = time_writer(folder, form, 50_000)
        print(
            f"  writer thread, {form} line:{' ' * (5 - len(form))}    {writer_us:.2f} µs a line "
            "(formatted and appended off the event loop, in batches of 50,000)"
        )
    off, on, written = whole_path(options.requests, options.rounds, folder)
    shutil.rmtree(folder, ignore_errors=True)
    print(
        f"  GET /v1/models in process:    {off:.1f} µs without, {on:.1f} µs with the access log "
        f"(median of {options.rounds * options.requests:,} each, interleaved rounds): "
        f"{(on - off) / 1000:+.4f} ms a request, {written:,} lines written"
    )


if __name__ == "__main__":
    main()
