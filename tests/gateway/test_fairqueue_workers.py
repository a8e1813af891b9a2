"""Fair queueing end to end, through the two gateway worker processes the run command starts
(uvicorn --workers 2 on one port, sharing VAR_DIR/gateway-queue), against an engine with one
slot and a first-come queue behind it, as llama-server has.

One person keeps FLOOD requests going at once, each from a key of her own (a person's many keys
get one person's share), all on one worker; another person's key sends one request at a time, by turns on a connection the other worker accepted and on one the flood's worker
accepted. Which worker holds a connection is read from the kernel (the worker process that owns
the accepted socket), so the test knows, rather than hopes, that the victim's requests on the
other worker got their turns ahead of a queue that process never saw: the flood's worker frees
every slot, and hands it to its own flood before the other worker's next look unless the two
share one queue (with `_my_turn` blind to the other process, the victim there waited 1.2-6.7 s).

With LLMGW_FAIR_QUEUE=off the same victim waits in the engine's queue behind the whole flood:
the contrast that shows the bound below means something.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from gateway.fairqueue import waiting_on_machine
from tests.support.gateway_processes import chat_on_engine
from tests.support.system import System, free_port
from tests.support.waiting import wait_for

MODEL = "chat"
ANSWER_SECONDS = 0.3  # the engine's time for one answer, in its one slot
FLOOD = 12  # the flood key's requests in flight at once
VICTIM_TURNS = 8  # the victim's requests during the flood, half on each worker
UNFAIR_TURNS = 2  # and with the fair queue off (each waits about 4 s)
# Fair: the victim waits for the answer in the slot, then has its own (2 answers; the grace a
# process gives another's first waiter is 0.05 s). Off: it waits behind the FLOOD - 1 requests
# queued in the engine (about 13 answers).
FAIR_BOUND = 3 * ANSWER_SECONDS
UNFAIR_AT_LEAST = 6 * ANSWER_SECONDS

# The victim's key (bob's) and the flood's (alice's, one per request in flight), after
# chat_on_engine's script (alice's `actor`).
_KEYS = f"""
bob = Actor.for_user(get_user_model().objects.create_user("bob", password="bob-password-1"), "api")
flood = [key_create(actor=actor, name=f"flood-{{i}}")[1] for i in range({FLOOD})]
print("KEYS", key_create(actor=bob, name="victim")[1], *flood)
"""


# -- the engine -------------------------------------------------------------------------------


@dataclass
class OneSlotEngine:
    """One answer at a time, ANSWER_SECONDS each; the rest wait first come, first served (an
    asyncio.Semaphore wakes its waiters in order). Notes who was answered when, and how many
    requests it holds (answering or waiting for its slot). Told to `hurry`, it answers what it
    holds at once (the test is done measuring, not waiting)."""

    answers: list[tuple[str, float, float]] = field(default_factory=list)  # prompt, began, ended
    holding: int = 0
    hurried: bool = False
    _slot: asyncio.Semaphore | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        prompt = json.loads(raw or b"{}").get("prompt", "")
        if self._slot is None:
            self._slot = asyncio.Semaphore(1)
        self.holding += 1
        try:
            async with self._slot:
                began = time.monotonic()
                while not self.hurried and time.monotonic() < began + ANSWER_SECONDS:
                    # The answer's time (what the victim's wait is measured against), in steps
                    # short enough to see `hurried`.
                    left = began + ANSWER_SECONDS - time.monotonic()
                    await asyncio.sleep(min(0.01, left))  # paces the answer: time is tested
                self.answers.append((prompt, began, time.monotonic()))
        finally:
            self.holding -= 1
        body = json.dumps(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
            }
        ).encode()
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

    def busy_share(self, since: float, until: float) -> float:
        """The share of [since, until] the slot spent answering."""
        busy = sum(max(0.0, min(e, until) - max(b, since)) for _, b, e in self.answers)
        return busy / (until - since)


@pytest.fixture
def engine() -> Iterator[tuple[OneSlotEngine, int]]:
    import uvicorn

    app = OneSlotEngine()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    )
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=10, interval=0.01, what="the fake engine")
    yield app, server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)


# -- clients ----------------------------------------------------------------------------------


class Connection:
    """One kept-alive connection to the gateway: whichever worker accepted it answers every
    request sent on it."""

    def __init__(self, port: int, secret: str) -> None:
        self.http = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.secret = secret  # sent with each request: a connection is nobody's
        # Past the protocol's wait for a first request, and surely accepted by now.
        assert self.get("/v1/models") == 200
        assert self.http.sock is not None
        self.local_port = self.http.sock.getsockname()[1]

    def get(self, path: str) -> int:
        self.http.request("GET", path, headers={"Authorization": f"Bearer {self.secret}"})
        answer = self.http.getresponse()
        answer.read()
        return answer.status

    def ask(self, prompt: str) -> tuple[int, float]:
        """The answer's status and seconds."""
        started = time.monotonic()
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4})
        headers = {"Authorization": f"Bearer {self.secret}", "Content-Type": "application/json"}
        self.http.request("POST", "/v1/completions", body=body, headers=headers)
        answer = self.http.getresponse()
        answer.read()
        return answer.status, time.monotonic() - started

    def close(self) -> None:
        self.http.close()


def owners(supervisor: int, gateway_port: int) -> dict[int, int]:
    """Client port -> the pid of the gateway worker that holds the other end, from /proc: the
    kernel's table of TCP sockets (ports and inode) and each worker's open sockets."""
    inodes = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], int(fields[9])
        if int(local.split(":")[1], 16) == gateway_port and remote != "00000000:0000":
            inodes[inode] = int(remote.split(":")[1], 16)
    found = {}
    for worker in _children(supervisor):
        for fd in Path(f"/proc/{worker}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                found[inodes[int(target[8:-1])]] = worker
    return found


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def pinned(
    supervisor: int, port: int, secret: str, *, on_busy: int, on_quiet: int
) -> tuple[list[Connection], list[Connection]]:
    """Connections opened until one worker (the busy one) holds `on_busy` of them and the other
    `on_quiet`; the surplus is closed."""
    by_worker: dict[int, list[Connection]] = {}
    for _ in range(80):
        connection = Connection(port, secret)
        owner = owners(supervisor, port)[connection.local_port]
        by_worker.setdefault(owner, []).append(connection)
        counts = sorted((len(c), pid) for pid, c in by_worker.items())
        if len(counts) == 2 and counts[0][0] >= on_quiet and counts[1][0] >= on_busy:
            quiet, busy = by_worker[counts[0][1]], by_worker[counts[1][1]]
            for extra in quiet[on_quiet:] + busy[on_busy:]:
                extra.close()
            return busy[:on_busy], quiet[:on_quiet]
    pytest.fail(f"80 connections did not reach both gateway workers: {by_worker}")


@dataclass
class Flood:
    """FLOOD requests in flight at once, each connection sending its next when one ends."""

    connections: list[Connection]
    statuses: list[int] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for connection in self.connections:
            thread = threading.Thread(target=self._send, args=(connection,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _send(self, connection: Connection) -> None:
        while not self.stop.is_set():
            self.statuses.append(connection.ask("flood")[0])

    def finish(self) -> None:
        """Send no more, and wait for the answers to what was sent."""
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in self.threads)


# -- the test ---------------------------------------------------------------------------------


def test_a_victim_is_served_within_two_answers_while_a_flood_fills_the_other_worker(
    tmp_path: Path, engine: tuple[OneSlotEngine, int]
) -> None:
    fake, engine_port = engine
    system = System(tmp_path / "system")
    try:
        printed = system.manage(
            "shell",
            "-c",
            "from django.core.management import call_command\n"
            "call_command('migrate', verbosity=0)\n" + chat_on_engine(engine_port) + _KEYS,
        )
        victim_key, *flood_keys = printed.split("KEYS")[1].split()
        flood_key = flood_keys[0]
        ports = start_gateways(system, tmp_path, victim_key)
        on = system.processes["gateway-on"].pid

        # -- fair queue on: the flood on one worker, the victim on both ----------------------
        flood_connections, [elsewhere] = pinned(
            on, ports["on"], flood_key, on_busy=FLOOD, on_quiet=1
        )
        for connection, key in zip(flood_connections, flood_keys, strict=True):
            connection.secret = key
        flood_worker = owners(on, ports["on"])[flood_connections[0].local_port]
        elsewhere.secret = victim_key
        beside = Connection(ports["on"], victim_key)
        for _ in range(40):
            if owners(on, ports["on"])[beside.local_port] == flood_worker:
                break
            beside.close()
            beside = Connection(ports["on"], victim_key)
        else:
            pytest.fail("no victim connection reached the flood's worker in 40 tries")
        workers = owners(on, ports["on"])
        assert {workers[c.local_port] for c in flood_connections} == {flood_worker}
        assert workers[elsewhere.local_port] != flood_worker

        flood = Flood(flood_connections)
        flood.start()
        # The flood fills the queue before the victim measures: one request in the slot, the
        # rest waiting in the gateway.
        queue_folder = tmp_path / "var-on" / "gateway-queue"
        wait_for(
            lambda: waiting_on_machine(queue_folder, [MODEL])[MODEL] == FLOOD - 1,
            timeout=30,
            what=f"{FLOOD - 1} flood requests waiting in the gateway's queue",
        )
        opened = time.monotonic()
        latencies: dict[str, list[float]] = {"the other worker": [], "the flood's worker": []}
        for turn in range(VICTIM_TURNS):
            where, connection = (
                ("the other worker", elsewhere) if turn % 2 == 0 else ("the flood's worker", beside)
            )
            status, seconds = connection.ask(f"victim-{turn}")
            assert status == 200
            latencies[where].append(seconds)
        closed = time.monotonic()
        fake.hurried = True
        flood.finish()
        fake.hurried = False
        shown = {where: [round(s, 2) for s in them] for where, them in latencies.items()}

        # The victim waited for about the answer in the slot, on either worker: the flood's
        # queue, all of it on one worker, did not hold it back.
        for where, them in latencies.items():
            assert statistics.median(them) <= FAIR_BOUND, f"victim on {where}: {shown}"
        assert max(max(them) for them in latencies.values()) <= 2 * FAIR_BOUND, shown
        # Work-conserving: a slot freed by either worker was taken at once, whichever worker's
        # request was next (the grace another worker's first waiter gets is 0.05 s).
        busy = fake.busy_share(opened, closed)
        assert busy >= 0.75, f"the engine's slot was busy {busy:.0%} of the flood"
        # The flood waited in the queue, and every request it sent was answered: the queue holds
        # requests back, it does not drop them.
        assert flood.statuses and set(flood.statuses) == {200}, set(flood.statuses)
        assert [p for p, _, _ in fake.answers].count("flood") == len(flood.statuses)
        scraped = requests.get(f"http://127.0.0.1:{ports['on']}/metrics", timeout=5).text
        assert f'llmgw_gateway_queue_seconds_count{{model="{MODEL}",outcome="served"}}' in scraped
        for connection in (*flood_connections, elsewhere, beside):
            connection.close()
        system.stop_process("gateway-on")

        # -- fair queue off: the victim waits behind the flood in the engine's queue ---------
        flood = Flood([Connection(ports["off"], key) for key in flood_keys])
        victim = Connection(ports["off"], victim_key)
        flood.start()
        # Without the fair queue the whole flood waits in the engine's own queue.
        wait_for(
            lambda: fake.holding == FLOOD,
            timeout=30,
            what=f"{FLOOD} flood requests held by the engine",
        )
        unfair = [victim.ask(f"unfair-{turn}")[1] for turn in range(UNFAIR_TURNS)]
        fake.hurried = True
        flood.finish()
        assert set(flood.statuses) == {200}
        assert statistics.median(unfair) >= UNFAIR_AT_LEAST, (unfair, shown)
    finally:
        fake.hurried = True  # nothing left for a gateway to wait for as it stops
        system.close()


def start_gateways(system: System, tmp_path: Path, secret: str) -> dict[str, int]:
    """Two gateways as the run command starts one (uvicorn, 2 workers), the fair queue on and
    off, each with a VAR_DIR of its own (their queues and load counts are theirs); started at
    once, to wait for their start once. Their ports."""
    from llmgw_site.management.commands.llmgw_run import gateway_command

    bin_dir = Path(sys.executable).parent
    ports = {}
    for mode in ("on", "off"):
        ports[mode] = free_port()
        system._spawn(
            f"gateway-{mode}",
            gateway_command(bin_dir, "127.0.0.1", ports[mode], workers=2),
            {
                **system.env,
                "LLMGW_FAIR_QUEUE": mode,
                "LLMGW_VAR_DIR": str(tmp_path / f"var-{mode}"),
                "LLMGW_METRICS_DIR": str(tmp_path / f"metrics-{mode}"),
            },
        )
    for mode, port in ports.items():
        wait_for(
            lambda port=port: (
                requests.get(
                    f"http://127.0.0.1:{port}/v1/models",
                    headers={"Authorization": f"Bearer {secret}"},
                    timeout=2,
                ).ok
            ),
            timeout=60,
            interval=0.1,  # a look is an HTTP request to the gateway starting
            what=f"the gateway with the fair queue {mode} (log: {system.logs[f'gateway-{mode}']})",
        )
        # Each worker's queue is there once it has started.
        queues = tmp_path / f"var-{mode}" / "gateway-queue"
        wait_for(
            lambda queues=queues: len(list(queues.glob("queue-*"))) == 2,
            timeout=30,
            what=f"both workers' queue files in {queues}",
        )
    return ports
