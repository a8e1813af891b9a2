"""Whether one person's flood holds up another person's requests: a victim key sending one request
at a time, alone and while another person holds 32 streams open from one key, or spread over 16
keys of theirs (the fair queue shares slots between people, so many keys buy no more), against a fake engine that computes 4
answers at once and queues the rest first come, first served (as llama-server does).

The engine (this file run with --engine PORT) answers in 0.8-1.2 s (uniform, seeded: answers
differ in length, so its slots free at different moments), streamed in 20 events or whole; a
request whose client hangs up while it is queued is dropped. Its capacity is 4 answers a second.

Paths, each on the same engine: the gateway as the run command starts it (uvicorn, 2 worker
processes, a SQLite database with one replica of 4 slots), with fair queueing off
(LLMGW_FAIR_QUEUE=off: every request is sent on at once, as on main before fair queueing) and on
(only when gateway/asgi.py wires gateway.fairqueue; the run checks /metrics for its figures), and
LiteLLM's proxy (2 workers; installed into a venv of its own the first time, see bench/gateway.py;
--no-litellm skips it).

Per path it prints the victim's median and p90 latency alone and during the flood, their ratio,
and the engine's work during the flood: answers a second for the flood and the victim against the
capacity, and the share of slot time the engine was busy. Targets (issue 21): the victim's median
during the flood <= 1.5x alone (8.9x before fair queueing); the flood keeps >= 85% of the capacity
(read here as the capacity the victim leaves it: a victim at one request at a time takes about a
fifth of 4 slots when it is served fairly, which no fair order can give back to the flood; the
flood's share of the whole capacity is printed beside it).

Run: make bench, or .venv/bin/python bench/fairness.py [--quick] [--no-litellm] [--victims N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import (  # noqa: E402
    DATABASE_PRELUDE,
    LITELLM_INSTALL_SECONDS,
    LITELLM_KEY,
    LITELLM_VENV,
    LITELLM_VERSION,
    WORKERS,
    Processes,
    free_port,
    gateway_env,
    litellm_install,
    litellm_installed,
    percentile,
    prepare_database,
    start_litellm,
    wait_http,
)

MODEL = "bench-fair"
SLOTS = 4
ANSWER_SECONDS = (0.8, 1.2)
EVENTS = 20
FLOOD_STREAMS = 32
# The keys of one person the flood is spread over in its last row (issue 37: a user's 16 keys).
FLOOD_KEYS = 16
# Time for the flood's 32 requests to reach the engine (or the gateway's queue) before the victim
# starts measuring.
SETTLE_SECONDS = 2.0
# How long to wait, between two paths, for the engine to finish what the last one left it.
DRAIN_SECONDS = 60
TARGET_RATIO = 1.5
TARGET_FLOOD_SHARE = 0.85
CAPACITY = SLOTS / (sum(ANSWER_SECONDS) / 2)


# -- the fake engine ------------------------------------------------------------------------


class Engine:
    """4 slots, a first-come queue behind them, and figures at /_stats."""

    def __init__(self) -> None:
        self.slots = asyncio.Semaphore(SLOTS)  # wakes its waiters in the order they came
        self.random = random.Random(21)
        self.queued = 0
        self.busy = 0
        self.answered = 0
        self.answer_seconds = 0.0  # of the answers given: what the capacity is measured from
        self.busy_seconds = 0.0  # slot time in use, up to `counted_at`
        self.counted_at = time.monotonic()
        self.dropped = 0

    def _count_busy(self, change: int) -> None:
        now = time.monotonic()
        self.busy_seconds += self.busy * (now - self.counted_at)
        self.counted_at = now
        self.busy += change

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = "startup" if message["type"] == "lifespan.startup" else "shutdown"
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        if scope["path"] in ("/health", "/v1/models"):
            await _whole(send, b'{"status": "ok"}')
            return
        if scope["path"] == "/_stats":
            self._count_busy(0)
            figures = {
                "queued": self.queued,
                "busy": self.busy,
                "answered": self.answered,
                "busy_seconds": self.busy_seconds,
                "answer_seconds": self.answer_seconds,
                "dropped": self.dropped,
            }
            await _whole(send, json.dumps(figures).encode())
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw or b"{}")
        # A client that hangs up while its request waits for a slot takes it out of the queue
        # (llama-server notices a closed connection too), so one path's leftovers do not hold
        # up the next.
        gone = asyncio.ensure_future(_hung_up(receive))
        self.queued += 1
        taking = asyncio.ensure_future(self.slots.acquire())
        try:
            await asyncio.wait({taking, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.queued -= 1
        if not taking.done() or taking.cancelled():
            taking.cancel()
            self.dropped += 1
            return
        seconds = self.random.uniform(*ANSWER_SECONDS)
        self._count_busy(1)
        try:
            if body.get("stream"):
                await _stream(send, seconds)
            else:
                await asyncio.sleep(seconds)
                await _whole(send, _ANSWER)
            self.answered += 1
            self.answer_seconds += seconds
        finally:
            self._count_busy(-1)
            self.slots.release()
            gone.cancel()


async def _hung_up(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


_ANSWER = json.dumps(
    {
        "id": "chatcmpl-fair",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23},
    }
).encode()


async def _stream(send: Any, seconds: float) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for index in range(EVENTS):
        await asyncio.sleep(seconds / EVENTS)
        event = {
            "id": "chatcmpl-fair",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": f"t{index} "}, "finish_reason": None}],
        }
        data = b"data: " + json.dumps(event).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _whole(send: Any, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# -- measuring ------------------------------------------------------------------------------


class Counter(dict[str, int]):
    def add(self, what: str) -> None:
        self[what] = self.get(what, 0) + 1


@dataclass
class Outcome:
    alone: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=lambda: Counter())
    window: float = 0.0
    flood_answers: int = 0
    victim_answers: int = 0
    engine_busy: float = 0.0  # share of slot time the engine computed during the window
    capacity: float = CAPACITY  # answers a second with every slot busy, measured in the window
    note: str = ""


def body_of(stream: bool) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 20,
            "stream": stream,
        }
    ).encode()


async def one(session: Any, url: str, headers: dict[str, str], stream: bool) -> float | str:
    """Seconds to the last byte, or what went wrong."""
    import aiohttp

    started = time.monotonic()
    try:
        async with session.post(url, data=body_of(stream), headers=headers) as response:
            async for _ in response.content.iter_any():
                pass
            if response.status != 200:
                return f"HTTP {response.status}"
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return type(exc).__name__
    return time.monotonic() - started


async def engine_stats(session: Any, engine: str) -> dict[str, Any]:
    async with session.get(f"{engine}/_stats") as response:
        return dict(await response.json())


async def drain(session: Any, engine: str) -> None:
    deadline = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < deadline:
        figures = await engine_stats(session, engine)
        if not figures["busy"] and not figures["queued"]:
            return
        await asyncio.sleep(0.2)


async def measure(
    url: str, victim: dict[str, str], floods: list[dict[str, str]], engine: str, victims: int
) -> Outcome:
    import aiohttp

    outcome = Outcome()
    timeout = aiohttp.ClientTimeout(total=600)
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session,
        aiohttp.ClientSession() as stats,
    ):
        await drain(stats, engine)
        await one(session, url, victim, False)  # connections, each worker's first request
        for _ in range(victims):
            result = await one(session, url, victim, False)
            if isinstance(result, str):
                outcome.errors.add(f"victim alone: {result}")
            else:
                outcome.alone.append(result)

        finished: list[float] = []
        stop = asyncio.Event()

        async def flooding(flood: dict[str, str]) -> None:
            while not stop.is_set():
                result = await one(session, url, flood, True)
                if isinstance(result, str):
                    outcome.errors.add(f"flood: {result}")
                    await asyncio.sleep(0.1)
                else:
                    finished.append(time.monotonic())

        streams = [
            asyncio.create_task(flooding(floods[i % len(floods)])) for i in range(FLOOD_STREAMS)
        ]
        await asyncio.sleep(SETTLE_SECONDS)
        before = await engine_stats(stats, engine)
        opened = time.monotonic()
        for _ in range(victims):
            result = await one(session, url, victim, False)
            if isinstance(result, str):
                outcome.errors.add(f"victim during the flood: {result}")
            else:
                outcome.during.append(result)
        closed = time.monotonic()
        after = await engine_stats(stats, engine)
        stop.set()
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        outcome.window = closed - opened
        outcome.flood_answers = sum(1 for at in finished if opened <= at <= closed)
        outcome.victim_answers = len(outcome.during)
        outcome.engine_busy = (after["busy_seconds"] - before["busy_seconds"]) / (
            SLOTS * outcome.window
        )
        answers = after["answered"] - before["answered"]
        if answers:
            mean = (after["answer_seconds"] - before["answer_seconds"]) / answers
            outcome.capacity = SLOTS / mean
        await drain(stats, engine)
    return outcome


def report(name: str, outcome: Outcome) -> None:
    if not outcome.alone or not outcome.during:
        print(f"{name:<30} no figures: {dict(outcome.errors)}")
        return
    alone = percentile(outcome.alone, 0.5)
    during = percentile(outcome.during, 0.5)
    ratio = during / alone
    flood_rate = outcome.flood_answers / outcome.window
    victim_rate = outcome.victim_answers / outcome.window
    left = outcome.capacity - victim_rate
    kept = flood_rate / left if left > 0 else 0.0
    print(
        f"{name:<30}{alone:>8.2f}{percentile(outcome.alone, 0.9):>8.2f}{during:>9.2f}"
        f"{percentile(outcome.during, 0.9):>8.2f}{ratio:>7.1f}x {'met' if ratio <= TARGET_RATIO else 'NOT met':<8}"
        f"{flood_rate:>7.2f}{victim_rate:>7.2f}{kept * 100:>7.0f}% "
        f"{'met' if kept >= TARGET_FLOOD_SHARE else 'NOT met':<8}"
        f"{flood_rate / outcome.capacity * 100:>6.0f}%{outcome.engine_busy * 100:>7.0f}%"
        f"{sum(outcome.errors.values()):>7}"
    )
    if outcome.errors:
        print(f"{'':<30}errors: {dict(outcome.errors)}")
    if outcome.note:
        print(f"{'':<30}{outcome.note}")


HEADER = (
    f"{'path':<30}{'alone':>8}{'p90':>8}{'flood':>9}{'p90':>8}{'ratio':>8} {'<=1.5x':<8}"
    f"{'flood/s':>7}{'vict/s':>7}{'kept':>8} {'>=85%':<8}{'of cap':>7}{'busy':>7}{'errors':>7}"
)


# -- the processes --------------------------------------------------------------------------


def prepare(folder: Path, engine_port: int) -> tuple[dict[str, str], str, list[str]]:
    """The bench database: the model with one 4-slot replica on the engine, the victim's key
    (bob's) and the flood's FLOOD_KEYS keys (the bench user's)."""
    env = gateway_env(folder)
    script = (
        DATABASE_PRELUDE
        + f"""
model_add(actor=actor, source_check=False, definition=clean_definition({{
    "name": "{MODEL}", "source": "http://127.0.0.1:9/bench.gguf", "min_replicas": 1,
    "profiles": [{{"name": "cpu", "memory_gb": 1, "cores": 1}}]}}))
Replica.objects.create(model=Model.objects.get(name="{MODEL}"), model_name="{MODEL}", node=node,
    profile="cpu", spec={{"slots": {SLOTS}}}, spec_key="bench", state=Replica.READY,
    port={engine_port})
bob = Actor.for_user(get_user_model().objects.create_user("bob", password="bob-password-1"), "api")
print(key_create(actor=bob, name="victim")[1],
      *[key_create(actor=actor, name=f"flood-{{i}}")[1] for i in range({FLOOD_KEYS})])
"""
    )
    victim, *floods = prepare_database(script, env).split()
    return env, victim, floods


def stop(processes: Processes, name: str) -> None:
    process = processes.running.pop(name, None)
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def wired() -> bool:
    """Whether the gateway in this tree queues fairly at all (gateway/asgi.py uses the queue)."""
    return "fairqueue" in (ROOT / "gateway" / "asgi.py").read_text()


def queue_metrics(gateway: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as response:
        return b"llmgw_gateway_queue_seconds" in response.read()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--victims", type=int, default=10, help="victim requests per phase")
    parser.add_argument("--quick", action="store_true", help="4 victim requests per phase")
    parser.add_argument("--no-litellm", action="store_true", help="measure without LiteLLM")
    args = parser.parse_args()
    if args.engine:
        import uvicorn

        uvicorn.run(
            Engine(),
            host="127.0.0.1",
            port=args.engine,
            loop="uvloop",
            http="httptools",
            access_log=False,
            log_level="warning",
        )
        return 0
    victims = 4 if args.quick else args.victims
    installing = None if args.no_litellm else litellm_install()
    results: list[tuple[str, Outcome]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-fair-") as tmp:
        folder = Path(tmp)
        processes = Processes(folder)
        try:
            engine_port = free_port()
            processes.start("engine", [sys.executable, __file__, "--engine", str(engine_port)])
            engine = f"http://127.0.0.1:{engine_port}"
            wait_http(f"{engine}/health", "the fake engine")
            env, victim_key, flood_keys = prepare(folder, engine_port)
            from llmgw_site.management.commands.llmgw_run import gateway_command

            url_path = "/v1/chat/completions"
            modes = ["off", "on"] if wired() else ["off"]
            runs = [(mode, 1) for mode in modes] + ([("on", FLOOD_KEYS)] if "on" in modes else [])
            for mode, keys in runs:
                port = free_port()
                argv = gateway_command(
                    Path(sys.executable).parent, "127.0.0.1", port, workers=WORKERS
                )
                processes.start(f"llmgw-{mode}", argv, {**env, "LLMGW_FAIR_QUEUE": mode})
                gateway = f"http://127.0.0.1:{port}"
                victim = {"Authorization": f"Bearer {victim_key}"}
                wait_http(f"{gateway}/v1/models", "the gateway", headers=victim)
                floods = [{"Authorization": f"Bearer {key}"} for key in flood_keys[:keys]]
                named = f"llmgw fair queue {mode}" + (f", {keys} keys" if keys > 1 else "")
                print(f"measuring {named} ...", file=sys.stderr, flush=True)
                outcome = asyncio.run(measure(gateway + url_path, victim, floods, engine, victims))
                if mode == "on" and not queue_metrics(gateway):
                    outcome.note = "no llmgw_gateway_queue_seconds in /metrics: is the queue wired?"
                results.append((named, outcome))
                stop(processes, f"llmgw-{mode}")
            if "on" not in modes:
                print(
                    "gateway/asgi.py does not use gateway.fairqueue yet: measured the gateway "
                    "without fair queueing only.",
                    file=sys.stderr,
                )
            if not args.no_litellm:
                if installing is not None:
                    try:
                        installing.wait(timeout=LITELLM_INSTALL_SECONDS)
                    except subprocess.TimeoutExpired:
                        os.killpg(installing.pid, signal.SIGKILL)
                if litellm_installed():
                    try:
                        litellm = start_litellm(processes, folder, engine_port, (MODEL,))
                        both = {"Authorization": f"Bearer {LITELLM_KEY}"}
                        print("measuring LiteLLM ...", file=sys.stderr, flush=True)
                        outcome = asyncio.run(
                            measure(litellm + url_path, both, [both], engine, victims)
                        )
                        outcome.note = "one master key for both: LiteLLM has no per-key order"
                        results.append((f"LiteLLM {LITELLM_VERSION}", outcome))
                    except RuntimeError as exc:
                        print(f"LiteLLM's proxy did not start ({exc}); measured without it.")
                else:
                    print(
                        f"litellm[proxy]=={LITELLM_VERSION} could not be installed into {LITELLM_VENV}."
                    )
        finally:
            processes.stop_all()
    print(
        f"\nfairness bench: fake engine of {SLOTS} slots, {ANSWER_SECONDS[0]}-{ANSWER_SECONDS[1]} s "
        f"an answer (capacity {CAPACITY:.1f}/s), first come first served behind them; victim: "
        f"{victims} whole answers one at a time, alone then while the flood holds "
        f"{FLOOD_STREAMS} streams; {WORKERS} gateway workers; {os.cpu_count()} cores shared"
    )
    print("latency in seconds (median, p90); flood/s and vict/s: answers a second in the window;")
    print("kept: the flood's share of the capacity the victim leaves; of cap: of the whole")
    print("(capacity: 4 slots over the mean answer time in the window); busy: the engine's slot")
    print("time used\n")
    print(HEADER)
    for name, outcome in results:
        report(name, outcome)
    print(
        f"\ntargets (issues 21 and 37): victim median during the flood <= {TARGET_RATIO}x alone "
        f"(8.9x before fair queueing), with the flood on one key or on {FLOOD_KEYS} keys of one "
        f"person; the flood keeps >= {TARGET_FLOOD_SHARE:.0%} of the capacity"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
