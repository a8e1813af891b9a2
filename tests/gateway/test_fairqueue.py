"""Fair queueing (gateway.fairqueue): the order between keys, across a machine's gateway
processes, work conservation, the bounds and leaving the queue.

A model here has one replica; the tests keep its slots busy so that requests queue, then free
one slot at a time and read the order in which the requests were granted.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import json
import multiprocessing
import os
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.env import EnvError
from gateway import conf, fairqueue
from gateway.fairqueue import (
    HEAP_SLACK,
    STALE_SECONDS,
    WAITING,
    ClientGone,
    FairQueue,
    QueueFull,
    QueueTimeout,
    client_gone,
    name_hash,
    waiting_on_machine,
)
from gateway.load import SharedLoad
from gateway.routing import Balancer, Candidate
from tests.support.waiting import stays, wait_for_async

REPLICA = Candidate(id="r1", model="m", state="ready", address="127.0.0.1", port=1, slots=1)
NO_SUCH_PID = 2**22 + 12345


class Room:
    """Requests that each hold the slot they are granted until the test lets it go."""

    def __init__(
        self,
        queue: FairQueue,
        balancer: Balancer,
        replica: Candidate = REPLICA,
        *,
        shared_with: Room | None = None,
    ) -> None:
        self.queue, self.balancer, self.replica = queue, balancer, replica
        # Rooms of two processes' queues note their grants in one list.
        self.order: list[str] = shared_with.order if shared_with else []
        self.holding: list[asyncio.Event] = shared_with.holding if shared_with else []
        self.tasks: list[asyncio.Task[None]] = []

    async def send(self, label: str, **ask: Any) -> None:
        """Queue one request (it is in the queue when this returns)."""
        ask.setdefault("key_id", hash(label) % 1000)
        self.tasks.append(asyncio.create_task(self._request(label, ask)))
        await asyncio.sleep(0)  # yield to the loop: the request's task enters the queue

    async def _request(self, label: str, ask: dict[str, Any]) -> None:
        ask = {"timeout": 30, "limit": 10_000, **ask}
        async with self.queue.turn(
            model="m", candidates=[self.replica], balancer=self.balancer, **ask
        ) as granted:
            chosen = self.balancer.choose([self.replica], "m", hold=granted.hold)
            self.order.append(label)
            held = asyncio.Event()
            self.holding.append(held)
            await held.wait()
            self.balancer.release(chosen)

    async def serve(self, count: int) -> list[str]:
        """Free the slot `count` times, one request after another."""
        start = len(self.order)
        for granted in range(start, start + count):
            if granted == 0:
                self.balancer.load.add(self.replica.id, -1)  # the slot the test held
            else:
                self.holding[granted - 1].set()
            await self._granted(granted + 1)
        return self.order[start:]

    async def _granted(self, count: int) -> None:
        await wait_for_async(
            lambda: len(self.order) >= count, timeout=5, what=f"{count} requests granted"
        )

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def a_waiter_of_key_1() -> Any:
    """What a board writes of a request waiting for model m: key 1's, with start tag 0."""
    flow = name_hash("m", "key:1")
    return SimpleNamespace(model_hash=name_hash("m"), flow_hash=flow, member_hash=flow,
                           top_hash=flow, start=0.0, finish=1.0, weight=1.0, person=1.0, order=0)  # fmt: skip


def busy_balancer(load: SharedLoad | None = None) -> Balancer:
    balancer = Balancer(load)
    balancer.load.add(REPLICA.id, 1)  # every slot busy: requests queue
    return balancer


# -- the order ------------------------------------------------------------------------------


def test_it_lets_a_request_through_at_once_when_a_slot_is_free() -> None:
    async def main() -> None:
        queue = FairQueue(None)
        balancer = Balancer()
        async with queue.turn(
            model="m", key_id=1, candidates=[REPLICA], balancer=balancer, timeout=1, limit=10
        ) as granted:
            assert granted.replica == REPLICA
            assert not granted.queued
            assert granted.waited == 0
            assert queue.depths() == {}

    asyncio.run(main())


def test_it_serves_a_key_of_one_within_one_answer_of_a_key_of_500() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(500):
            await room.send("flood", key_id=1)
        await room.send("victim", key_id=2)
        assert room.queue.depths() == {"m": 501}
        assert await room.serve(2) == ["flood", "victim"]
        await room.close()
        assert room.queue.depths() == {}
        assert room.queue.depth("m") == 0

    asyncio.run(main())


def test_it_takes_turns_between_two_keys_of_equal_weight() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(20):
            await room.send("a", key_id=1)
        for _ in range(5):
            await room.send("b", key_id=2)
        assert await room.serve(10) == ["a", "b"] * 5
        await room.close()

    asyncio.run(main())


def test_it_shares_slots_by_weight() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(30):
            await room.send("light", key_id=1, weight=1)
            await room.send("heavy", key_id=2, weight=2)
        served = Counter(await room.serve(30))
        assert abs(served["heavy"] - 20) <= 1 and abs(served["light"] - 10) <= 1, served
        await room.close()

    asyncio.run(main())


def test_it_gives_a_teams_keys_one_share_between_them() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(15):
            await room.send("team", key_id=1, team_id=7)
            await room.send("team", key_id=2, team_id=7)
            await room.send("alone", key_id=3)
        served = Counter(await room.serve(20))
        assert abs(served["team"] - 10) <= 1 and abs(served["alone"] - 10) <= 1, served
        await room.close()

    asyncio.run(main())


def test_a_persons_sixteen_keys_get_one_persons_share() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(5):
            for key in range(1, 17):
                await room.send("flood", key_id=key, user_id=1)
        for _ in range(10):
            await room.send("victim", key_id=100, user_id=2)
        served = Counter(await room.serve(20))
        assert abs(served["victim"] - 10) <= 1 and abs(served["flood"] - 10) <= 1, served
        await room.close()

    asyncio.run(main())


def test_a_person_asking_once_waits_one_turn_behind_another_persons_sixteen_keys() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(3):
            for key in range(1, 17):
                await room.send("flood", key_id=key, user_id=1)
        await room.serve(4)  # the flood is under way
        await room.send("victim", key_id=100, user_id=2)
        assert "victim" in await room.serve(2)
        await room.close()

    asyncio.run(main())


def test_a_teams_people_share_its_share_equally_whatever_their_keys() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(20):
            for key in (1, 2, 3):
                await room.send("ann", key_id=key, user_id=1, team_id=7)
            await room.send("bob", key_id=4, user_id=2, team_id=7)
            await room.send("alone", key_id=5, user_id=3)
        served = Counter(await room.serve(40))
        assert abs(served["ann"] - 10) <= 1 and abs(served["bob"] - 10) <= 1, served
        assert abs(served["alone"] - 20) <= 1, served
        await room.close()

    asyncio.run(main())


def test_a_persons_keys_share_their_share_by_weight() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(30):
            await room.send("heavy", key_id=1, user_id=1, weight=3)
            await room.send("light", key_id=2, user_id=1, weight=1)
            await room.send("other", key_id=3, user_id=2, weight=3)
        served = Counter(await room.serve(40))
        # The person's heaviest key in use sets their share (3, as the other's), split 3:1.
        assert abs(served["other"] - 20) <= 1, served
        assert abs(served["heavy"] - 15) <= 1 and abs(served["light"] - 5) <= 1, served
        await room.close()

    asyncio.run(main())


def test_a_teams_share_goes_to_its_people_by_the_weights_staff_gave_them() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(30):
            await room.send("lead", key_id=1, user_id=1, team_id=7, user_weight=3)
            await room.send("intern", key_id=2, user_id=2, team_id=7)
            await room.send("alone", key_id=3, user_id=3)
        served = Counter(await room.serve(40))
        assert abs(served["alone"] - 20) <= 1, served
        assert abs(served["lead"] - 15) <= 1 and abs(served["intern"] - 5) <= 1, served
        await room.close()

    asyncio.run(main())


def test_a_person_without_a_team_weighs_what_staff_gave_them_whatever_their_keys() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        for _ in range(30):
            await room.send("heavy", key_id=1, user_id=1, weight=5, user_weight=1)
            await room.send("other", key_id=2, user_id=2, user_weight=2)
        served = Counter(await room.serve(30))
        assert abs(served["other"] - 20) <= 1 and abs(served["heavy"] - 10) <= 1, served
        await room.close()

    asyncio.run(main())


def test_it_counts_a_keys_requests_in_service_against_its_share() -> None:
    """A key that already has two requests in service comes after one that has none."""

    async def main() -> None:
        replica = Candidate(id="r4", model="m", state="ready", address="h", port=1, slots=3)
        balancer = Balancer()
        room = Room(FairQueue(None, poll=0.005), balancer, replica)
        await room.send("busy")
        await room.send("busy")
        await room.send("other")  # three slots: all three go through at once
        await wait_for_async(lambda: len(room.order) == 3, timeout=5, what="three granted")
        await room.send("busy")
        await room.send("idle", key_id=99)
        room.holding[2].set()  # "other" ends: one slot free, two waiting
        await wait_for_async(lambda: len(room.order) == 4, timeout=5, what="a fourth granted")
        assert room.order[3] == "idle"
        await room.close()

    asyncio.run(main())


def test_a_waiter_whose_replicas_have_a_free_slot_is_not_held_back_by_the_head() -> None:
    """An adapter's waiter at the head, its one replica busy; the base model's replica frees."""

    async def main() -> None:
        adapter = Candidate(id="ra", model="m", state="ready", address="h", port=2, slots=1)
        balancer = busy_balancer()
        balancer.load.add(adapter.id, 1)
        queue = FairQueue(None, poll=0.005)
        room = Room(queue, balancer, adapter)
        base = Room(queue, balancer, shared_with=room)
        await room.send("adapter", key_id=1)
        await base.send("base", key_id=2)
        balancer.load.add(REPLICA.id, -1)
        await wait_for_async(lambda: room.order == ["base"], timeout=5, what="the base's grant")
        await room.close()
        await base.close()

    asyncio.run(main())


def test_a_granted_slot_stays_counted_until_the_requests_choice_takes_it_over() -> None:
    """Else another process could find the slot free between the grant and the choice."""

    async def main() -> None:
        queue = FairQueue(None, poll=0.005)
        balancer = busy_balancer()
        counted: list[int] = []

        async def ask() -> None:
            async with queue.turn(
                model="m", key_id=1, candidates=[REPLICA], balancer=balancer, timeout=5, limit=10
            ) as granted:
                assert granted.queued
                counted.append(balancer.load.total(REPLICA.id, time.monotonic()))
                chosen = balancer.choose([REPLICA], "m", hold=granted.hold)
                counted.append(balancer.load.total(REPLICA.id, time.monotonic()))
                balancer.release(chosen)

        task = asyncio.create_task(ask())
        await wait_for_async(lambda: queue.depths() == {"m": 1}, timeout=5, what="one waiting")
        balancer.load.add(REPLICA.id, -1)
        await asyncio.wait_for(task, 5)
        assert counted == [1, 1]
        assert balancer.load.total(REPLICA.id, time.monotonic()) == 0

    asyncio.run(main())


def test_a_turn_whose_block_chose_no_replica_gives_its_slot_back() -> None:
    async def main() -> None:
        balancer = Balancer()
        async with FairQueue(None).turn(
            model="m", key_id=1, candidates=[REPLICA], balancer=balancer, timeout=1, limit=10
        ) as granted:
            assert not granted.queued
            assert balancer.load.total(REPLICA.id, time.monotonic()) == 1
        assert balancer.load.total(REPLICA.id, time.monotonic()) == 0

    asyncio.run(main())


# -- across processes -----------------------------------------------------------------------


def _hold_the_grant_lock(folder: str, held: Any, let_go: Any) -> None:
    handle = os.open(Path(folder) / "grants.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(handle, fcntl.LOCK_EX)
    held.set()
    let_go.wait(20)
    fcntl.flock(handle, fcntl.LOCK_UN)


def test_it_hands_out_no_slot_while_another_process_holds_the_grant_lock(tmp_path: Path) -> None:
    """Finding a slot free and counting it are one step across processes: two processes that
    both read a slot free before either counted it would both hand it out."""
    balancer = busy_balancer()
    queue = FairQueue(tmp_path / "queue", poll=0.005)
    room = Room(queue, balancer)
    queued = threading.Event()

    async def wait_for_the_slot() -> None:
        await room.send("waiting", key_id=1)
        queued.set()
        await wait_for_async(lambda: room.order == ["waiting"], timeout=20, what="the grant")
        await room.close()

    # The dispatcher blocks its loop while it waits for the lock: the loop has a thread.
    waiting = threading.Thread(target=asyncio.run, args=(wait_for_the_slot(),))
    waiting.start()
    context = multiprocessing.get_context("fork")
    held, let_go = context.Event(), context.Event()
    other = context.Process(
        target=_hold_the_grant_lock, args=(str(tmp_path / "queue"), held, let_go)
    )
    try:
        assert queued.wait(5)
        other.start()
        assert held.wait(20)
        balancer.load.add(REPLICA.id, -1)  # free, while the other process decides
        stays(lambda: room.order == [], seconds=0.3, what="no grant while the lock is held")
        let_go.set()
        waiting.join(20)
        assert room.order == ["waiting"]
    finally:
        let_go.set()
        other.join(20)
        waiting.join(20)
        queue.close()


def test_the_grant_lock_is_taken_only_when_the_free_slots_are_fewer_than_the_processes(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A process grants one slot at a time; while a replica has a free slot for each gateway
    process, all of them granting at once still fit, and a request goes through without the
    machine's lock (a flock a request, the fast path's largest cost)."""
    queue = FairQueue(tmp_path / "queue", poll=0.005)
    real, taken = queue.board.granting, []

    class Counting:
        def __enter__(self) -> None:
            taken.append(1)
            real.__enter__()

        def __exit__(self, *exc_info: object) -> None:
            real.__exit__(*exc_info)

        def close(self) -> None:
            real.close()

    monkeypatch.setattr(queue.board, "granting", Counting())
    monkeypatch.setattr(queue.board, "processes", lambda: 3)  # itself and two others
    replica = Candidate(id="r4", model="m", state="ready", address="127.0.0.1", port=1, slots=4)
    balancer = Balancer()

    async def one() -> None:
        async with queue.turn(
            model="m", key_id=1, candidates=[replica], balancer=balancer, timeout=5, limit=100
        ) as granted:
            balancer.release(balancer.choose([replica], "m", hold=granted.hold))

    try:
        asyncio.run(one())  # 4 free, 3 processes: no lock
        assert taken == []
        balancer.load.add(replica.id, 2)  # 2 free, fewer than the processes: the lock
        asyncio.run(one())
        assert taken == [1]
    finally:
        queue.close()


def test_it_orders_the_waiters_of_two_processes_as_one_queue(tmp_path: Path) -> None:
    async def main() -> None:
        flood_side = FairQueue(tmp_path / "queue", pid=os.getppid(), grace=0.5, poll=0.005)
        victim_side = FairQueue(tmp_path / "queue", grace=0.5, poll=0.005)
        victim = Room(victim_side, busy_balancer(SharedLoad(tmp_path / "load")))
        flood_load = SharedLoad(tmp_path / "load", pid=os.getppid())
        flood = Room(flood_side, Balancer(flood_load), shared_with=victim)
        for _ in range(5):
            await flood.send("flood", key_id=1)
        await victim.send("victim", key_id=2)
        assert victim_side.depth("m") == flood_side.depth("m") == 6  # the machine's queue
        assert await victim.serve(3) == ["flood", "victim", "flood"]
        for room in (flood, victim):
            await room.close()
        for side in (flood_side, victim_side):
            side.close()
        flood_load.close()

    asyncio.run(main())


def test_a_process_back_from_a_pause_waits_for_the_first_waiter_that_could_not_run(
    tmp_path: Path,
) -> None:
    """test_it_is_fair_between_two_real_processes's flake, its interleaving forced. A slot frees,
    then the machine stops for longer than STALE_SECONDS (a loaded host, a long garbage
    collection; or the flood's process stops while it holds the grant lock, which the victim's
    process then waits at). The first process to run again must not take the victim's heartbeat,
    which nobody could write meanwhile, for a hung process's and hand its own flood the slot."""

    async def main() -> None:
        # Both polls long: a process passes only when the test wakes it, in the order forced.
        victim_side = FairQueue(tmp_path / "queue", poll=60)
        flood_side = FairQueue(tmp_path / "queue", pid=os.getppid(), poll=60)
        victim = Room(victim_side, busy_balancer(SharedLoad(tmp_path / "load")))
        flood_load = SharedLoad(tmp_path / "load", pid=os.getppid())
        flood = Room(flood_side, Balancer(flood_load), shared_with=victim)
        await victim.send("victim", key_id=2)
        await flood.send("flood", key_id=1)  # the same start tag, later: the victim is first
        queues = [side._models["m"] for side in (victim_side, flood_side)]
        await wait_for_async(
            lambda: not any(q.wake.is_set() for q in queues),
            timeout=5,
            what="both processes' first grant pass (the slot busy)",
        )
        victim.balancer.load.add(REPLICA.id, -1)  # the slot frees
        time.sleep(STALE_SECONDS + 0.2)  # the machine stops, both processes: the pause is tested
        queues[1].wake.set()  # the flood's process runs first
        await wait_for_async(lambda: not queues[1].wake.is_set(), timeout=5, what="its pass")
        assert flood_side.depths() == {"m": 1}, "the flood's process took the victim's turn"
        assert victim.order == []
        queues[0].wake.set()
        await wait_for_async(lambda: victim.order == ["victim"], timeout=5, what="the victim")
        for room in (flood, victim):
            await room.close()
        for side in (flood_side, victim_side):
            side.close()
        flood_load.close()
        victim.balancer.load.close()

    asyncio.run(main())


def test_another_process_reads_the_machines_queue_without_a_board(tmp_path: Path) -> None:
    async def main() -> None:
        queue = FairQueue(tmp_path / "queue", poll=0.005)
        room = Room(queue, busy_balancer())
        await room.send("a", key_id=1)
        await room.send("b", key_id=2)
        counts = waiting_on_machine(tmp_path / "queue", ["m", "other"])
        assert counts == {"m": 2, "other": 0}
        boards = sorted(p.name for p in (tmp_path / "queue").glob("queue-*"))
        assert boards == [f"queue-{os.getpid()}"]
        await room.close()
        queue.close()

    asyncio.run(main())


def test_it_hands_a_slot_on_after_the_grace_when_the_first_waiter_does_not_take_it(
    tmp_path: Path,
) -> None:
    """Work-conserving: a process whose first waiter cannot take the slot (its loop is stuck)
    holds it for the grace only."""

    async def main() -> None:
        stuck = FairQueue(tmp_path / "queue", pid=os.getppid(), grace=0.2, poll=0.005)
        stuck.grant = lambda q, now: None  # type: ignore[method-assign]
        here = FairQueue(tmp_path / "queue", grace=0.2, poll=0.005)
        balancer = busy_balancer(SharedLoad(tmp_path / "load"))
        first = Room(stuck, balancer)
        second = Room(here, balancer)
        await first.send("first", key_id=1)
        await second.send("second", key_id=2)
        freed = time.monotonic()
        balancer.load.add(REPLICA.id, -1)
        await wait_for_async(lambda: second.order == ["second"], timeout=5, what="the grant")
        waited = time.monotonic() - freed
        assert 0.2 <= waited < 2.0, waited
        for room in (first, second):
            await room.close()

    asyncio.run(main())


def test_it_ignores_the_waiters_of_a_dead_process(tmp_path: Path) -> None:
    async def main() -> None:
        dead = FairQueue(tmp_path / "queue", pid=NO_SUCH_PID)
        dead.board.add(a_waiter_of_key_1(), WAITING)
        here = FairQueue(tmp_path / "queue")
        async with here.turn(
            model="m", key_id=2, candidates=[REPLICA], balancer=Balancer(), timeout=1, limit=10
        ) as granted:
            assert not granted.queued
        assert not (tmp_path / "queue" / f"queue-{NO_SUCH_PID}").exists()

    asyncio.run(main())


def test_it_ignores_the_waiters_of_a_process_that_stopped_beating(tmp_path: Path) -> None:
    async def main() -> None:
        hung = FairQueue(tmp_path / "queue", pid=os.getppid())
        hung.board.add(a_waiter_of_key_1(), WAITING)
        hung.board.beat(time.monotonic() - 60)
        here = FairQueue(tmp_path / "queue")
        async with here.turn(
            model="m", key_id=2, candidates=[REPLICA], balancer=Balancer(), timeout=1, limit=10
        ) as granted:
            assert not granted.queued
        hung.close()
        here.close()

    asyncio.run(main())


# How long the victim's process below may stop (a long garbage collection of this big process)
# before its turn goes to the flood, by the grace or by the stale rule, whichever comes first:
# the fair order between running processes is tested there, not how a hung one is passed over.
STOPPED_AT_MOST = 5.0


def _flood_process(folder: str, ready: Any, grants: Any) -> None:
    async def main() -> None:
        balancer = Balancer(SharedLoad(Path(folder) / "load"))
        queue = FairQueue(Path(folder) / "queue", grace=STOPPED_AT_MOST, poll=0.005)

        async def one() -> None:
            async with queue.turn(
                model="m", key_id=1, candidates=[REPLICA], balancer=balancer, timeout=20, limit=99
            ) as granted:
                chosen = balancer.choose([REPLICA], "m", hold=granted.hold)
                grants.put(("flood", time.monotonic()))
                await asyncio.sleep(0.3)  # an answer's time in the slot: the order is timed
                balancer.release(chosen)

        tasks = []
        for _ in range(4):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(0)  # yield to the loop: each request enters in turn
        await wait_for_async(lambda: queue.depths().get("m") == 4, timeout=20, what="4 waiting")
        ready.set()
        await asyncio.gather(*tasks)
        queue.close()
        balancer.load.close()

    asyncio.run(main())


def test_it_is_fair_between_two_real_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood of 4 on another process, then a key of one here: the one is second at most."""
    monkeypatch.setattr(fairqueue, "STALE_SECONDS", STOPPED_AT_MOST)  # the flood's fork too
    balancer = busy_balancer(SharedLoad(tmp_path / "load"))
    queue = FairQueue(tmp_path / "queue", grace=STOPPED_AT_MOST, poll=0.005)
    context = multiprocessing.get_context("fork")
    ready, grants = context.Event(), context.Queue()
    flood = context.Process(target=_flood_process, args=(str(tmp_path), ready, grants))
    flood.start()
    try:
        assert ready.wait(20)

        async def main() -> float:
            async with queue.turn(
                model="m", key_id=2, candidates=[REPLICA], balancer=balancer, timeout=20, limit=99
            ) as granted:
                assert granted.queued
                chosen = balancer.choose([REPLICA], "m", hold=granted.hold)
                at = time.monotonic()
                await asyncio.sleep(0.3)  # an answer's time in the slot: the order is timed
                balancer.release(chosen)
                return at

        async def wait_and_free() -> float:
            waiting = asyncio.create_task(main())
            await wait_for_async(lambda: queue.depth("m") == 5, timeout=20, what="5 waiting")
            balancer.load.add(REPLICA.id, -1)  # the slot the test held
            return await waiting

        victim_at = asyncio.run(wait_and_free())
        flood.join(20)
        assert flood.exitcode == 0
        floods = sorted(grants.get(timeout=1)[1] for _ in range(4))
        place = sum(1 for at in floods if at < victim_at)
        assert place <= 1, (place, floods, victim_at)
    finally:
        if flood.is_alive():
            flood.kill()
        queue.close()
        balancer.load.close()


# -- the bounds -----------------------------------------------------------------------------


def test_it_answers_503_with_retry_after_when_the_wait_is_over() -> None:
    async def main() -> None:
        queue = FairQueue(None, poll=0.005)
        with pytest.raises(QueueTimeout) as raised:
            async with queue.turn(
                model="m",
                key_id=1,
                candidates=[REPLICA],
                balancer=busy_balancer(),
                timeout=0.1,
                limit=10,
            ):
                pytest.fail("granted while every slot was busy")
        refusal = raised.value.refusal()
        assert refusal.status == 503
        assert int(refusal.headers["Retry-After"]) >= 1
        assert refusal.json()["error"] == {
            "message": "Every slot of m stayed busy for the 0 seconds a request may wait in the "
            "gateway's queue (LLMGW_QUEUE_TIMEOUT). Try again; the Retry-After header says when.",
            "type": "server_error",
            "param": None,
            "code": "queue_timeout",
        }
        assert queue.depths() == {}
        assert queue.depth("m") == 0

    asyncio.run(main())


def test_it_answers_429_when_the_queue_is_full() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        await room.send("a", limit=2)
        await room.send("b", limit=2)
        with pytest.raises(QueueFull) as raised:
            async with room.queue.turn(
                model="m", key_id=3, candidates=[REPLICA], balancer=room.balancer, limit=2
            ):
                pytest.fail("queued past the limit")
        refusal = raised.value.refusal()
        assert refusal.status == 429
        assert refusal.headers["Retry-After"] == "2"
        assert json.loads(refusal.body())["error"] == {
            "message": "Every slot of m is busy and 2 requests already wait for it on this "
            "machine, as many as its queue holds (LLMGW_QUEUE_MAX=2). Try again shortly; the "
            "Retry-After header says when. More replicas of the model take more at once.",
            "type": "rate_limit_exceeded",
            "param": None,
            "code": "queue_full",
        }
        assert room.queue.depths() == {"m": 2}
        await room.close()

    asyncio.run(main())


def test_one_person_or_one_key_cannot_fill_a_models_queue() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        bounds = {"limit": 100, "per_user": 3, "per_key": 2}
        await room.send("a", key_id=1, user_id=1, **bounds)
        await room.send("a", key_id=1, user_id=1, **bounds)
        with pytest.raises(QueueFull) as by_key:
            async with room.queue.turn(model="m", key_id=1, user_id=1, candidates=[REPLICA],
                                       balancer=room.balancer, **bounds):  # fmt: skip
                pytest.fail("queued past the key's share")
        assert "2 requests of this key already wait for it, as many as one key may " in (
            by_key.value.refusal().body().decode()
        )
        assert "(LLMGW_QUEUE_MAX_PER_KEY=2)" in by_key.value.refusal().body().decode()
        await room.send("b", key_id=2, user_id=1, **bounds)  # the person's third
        with pytest.raises(QueueFull) as by_user:
            async with room.queue.turn(model="m", key_id=3, user_id=1, candidates=[REPLICA],
                                       balancer=room.balancer, **bounds):  # fmt: skip
                pytest.fail("queued past the person's share")
        refusal = by_user.value.refusal()
        assert refusal.status == 429 and "Retry-After" in refusal.headers
        assert (
            "3 requests of this key's owner already wait for it, as many as one person may "
            "(LLMGW_QUEUE_MAX_PER_USER=3)"
        ) in refusal.body().decode()
        # Someone else still gets in line.
        await room.send("other", key_id=9, user_id=2, **bounds)
        assert room.queue.depths() == {"m": 4}
        await room.close()

    asyncio.run(main())


def test_the_shares_of_the_queue_default_to_a_quarter_of_it(settings: Any) -> None:
    settings.LLMGW_QUEUE_MAX = 40
    assert (conf.queue_max_per_user(), conf.queue_max_per_key()) == (10, 10)
    settings.LLMGW_QUEUE_MAX_PER_KEY = 4
    assert (conf.queue_max_per_user(), conf.queue_max_per_key()) == (10, 4)


def test_requests_that_leave_behind_a_long_waiter_are_not_kept_in_memory() -> None:
    """A slot busy for long, one request waiting at the head all along, and ten times the
    queue's limit of requests behind it that hang up: the model's heap, which drops a leaver only
    when it comes up at the head, is built again without them instead of growing with each."""

    async def main() -> tuple[int, int, int]:
        queue = FairQueue(None, poll=0.005)
        balancer = busy_balancer()
        limit = 100
        hung_up = asyncio.Event()

        async def wait(key_id: int, **ask: Any) -> None:
            async with queue.turn(
                model="m", key_id=key_id, candidates=[REPLICA], balancer=balancer, **ask
            ):
                pytest.fail("granted while every slot was busy")

        head = asyncio.create_task(wait(0, timeout=30, limit=limit + 1))
        await wait_for_async(lambda: queue.depths() == {"m": 1}, timeout=5, what="one waiting")

        async def full_queue_hangs_up() -> None:
            hung_up.clear()
            behind = [
                asyncio.create_task(wait(key_id, hangup=hung_up.wait, timeout=30, limit=limit + 1))
                for key_id in range(1, limit + 1)
            ]
            await wait_for_async(
                lambda: queue.depths() == {"m": limit + 1}, timeout=5, what="the queue full"
            )
            hung_up.set()
            left = await asyncio.gather(*behind, return_exceptions=True)
            assert all(isinstance(outcome, ClientGone) for outcome in left)
            del left  # the exceptions hold their frames

        tracemalloc.start()
        try:
            await full_queue_hangs_up()
            gc.collect()  # the hang-ups' exceptions and their tasks' frames hold each other
            after_one = tracemalloc.get_traced_memory()[0]
            for _ in range(9):
                await full_queue_hangs_up()
            gc.collect()
            after_ten = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        heap = len(queue._models["m"].heap)
        head.cancel()
        await asyncio.gather(head, return_exceptions=True)
        return after_one, after_ten, heap

    after_one, after_ten, heap = asyncio.run(main())
    assert heap <= 2 * 1 + HEAP_SLACK  # the one waiting, and some of those who left
    # 900 requests more went through the queue: well under 100 bytes each stayed.
    assert after_ten - after_one < 900 * 100, (after_one, after_ten)


def test_ten_times_the_bound_of_keys_and_models_leave_the_queues_memory_flat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per key and per model, a process's queue holds only what is under way. Ten times as many
    keys in service at once as its file tracks: the flows held stop at ENTRIES (the rest go
    through untracked) and all go when their requests end. Ten times MAX_QUEUES models asked
    for, one request each: the models' queues stop at the bound, and memory with them. Both
    bounds are small here (64 and 100), which keeps the test short: each is a comparison with
    it, whatever its value."""
    monkeypatch.setattr(fairqueue, "ENTRIES", 64)
    monkeypatch.setattr(fairqueue, "MAX_QUEUES", 100)
    wide = Candidate(id="wide", model="m", state="ready", address="127.0.0.1", port=1, slots=10**6)

    async def main() -> tuple[list[int], int, int]:
        queue = FairQueue(None)
        balancer = Balancer()
        flows = []
        async with contextlib.AsyncExitStack() as stack:
            for key_id in range(10 * fairqueue.ENTRIES):
                await stack.enter_async_context(
                    queue.turn(model="m", key_id=key_id, candidates=[wide], balancer=balancer)
                )
                flows.append(queue.size()[1])
        assert queue.size() == (1, 0)  # every flow gone with its requests

        async def one_request(model: str) -> None:
            async with queue.turn(model=model, key_id=1, candidates=[wide], balancer=balancer):
                pass

        models = fairqueue.MAX_QUEUES
        most = [0, 0]  # the most memory held: while the bound is first passed, and after
        tracemalloc.start()
        try:
            for index in range(10 * models):
                await one_request(f"model-{index}")
                held = tracemalloc.get_traced_memory()[0]
                most[index >= 2 * models] = max(most[index >= 2 * models], held)
        finally:
            tracemalloc.stop()
        at_bound = most[0]
        assert queue.size()[0] <= models
        return flows, at_bound, most[1]

    flows, at_bound, most = asyncio.run(main())
    assert max(flows) == 64 and flows[63] == 64
    assert at_bound > 100 * 100  # what is measured holds the models' queues
    assert most < at_bound * 1.1, (at_bound, most)


def test_it_reads_its_bounds_from_the_settings(settings: Any) -> None:
    settings.LLMGW_QUEUE_TIMEOUT = 0.05
    settings.LLMGW_QUEUE_MAX = 0

    async def main() -> None:
        with pytest.raises(QueueFull):
            async with FairQueue(None).turn(
                model="m", key_id=1, candidates=[REPLICA], balancer=busy_balancer()
            ):
                pass

    asyncio.run(main())
    assert conf.queue_timeout() == 0.05
    assert conf.fair_queue_on() is True
    settings.LLMGW_FAIR_QUEUE = "off"
    assert conf.fair_queue_on() is False
    settings.LLMGW_QUEUE_MAX = "lots"
    with pytest.raises(EnvError, match="'lots' is not a number"):
        conf.queue_max()


def test_a_request_whose_wait_is_cancelled_leaves_the_queue_at_once() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        await room.send("gone", key_id=1)
        await room.send("stays", key_id=2)
        assert room.queue.depth("m") == 2
        room.tasks[0].cancel()
        await asyncio.sleep(0)  # yield to the loop once: the cancelled request runs its exit
        assert room.queue.depths() == {"m": 1}
        assert room.queue.depth("m") == 1
        assert await room.serve(1) == ["stays"]
        await room.close()

    asyncio.run(main())


def test_a_client_that_hangs_up_leaves_the_queue_at_once() -> None:
    async def main() -> None:
        queue = FairQueue(None, poll=0.005)
        hung_up = asyncio.Event()
        waits: list[float] = []
        queue.on_wait = lambda model, seconds, outcome: waits.append(outcome == "gone")

        async def ask() -> None:
            async with queue.turn(
                model="m",
                key_id=1,
                candidates=[REPLICA],
                balancer=busy_balancer(),
                hangup=hung_up.wait,
                timeout=30,
                limit=10,
            ):
                pytest.fail("granted while every slot was busy")

        task = asyncio.create_task(ask())
        await wait_for_async(lambda: queue.depths() == {"m": 1}, timeout=5, what="one waiting")
        hung_up.set()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(task, 1)
        assert queue.depths() == {}
        assert queue.depth("m") == 0
        assert waits == [True]

    asyncio.run(main())


def test_client_gone_returns_when_the_asgi_client_disconnects() -> None:
    sent: list[dict[str, Any]] = [
        {"type": "http.request", "body": b""},
        {"type": "http.disconnect"},
    ]
    messages = iter(sent)

    async def receive() -> dict[str, Any]:
        return next(messages)

    asyncio.run(asyncio.wait_for(client_gone(receive), 1))
    assert next(messages, None) is None


def test_a_slot_granted_as_the_wait_is_cancelled_goes_to_the_next() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        await room.send("first", key_id=1)
        await room.send("second", key_id=2)
        room.balancer.load.add(REPLICA.id, -1)
        room.queue.grant(room.queue._models["m"], time.monotonic())  # granted, not yet resumed
        room.tasks[0].cancel()
        await wait_for_async(lambda: room.order == ["second"], timeout=5, what="the next grant")
        await room.close()

    asyncio.run(main())


def test_it_reports_depth_and_queue_time() -> None:
    async def main() -> None:
        room = Room(FairQueue(None, poll=0.005), busy_balancer())
        depths: list[int] = []
        waits: list[tuple[str, str]] = []
        room.queue.on_depth = lambda model, depth: depths.append(depth)
        room.queue.on_wait = lambda model, seconds, outcome: waits.append((model, outcome))
        await room.send("a", key_id=1)
        await room.send("b", key_id=2)
        await room.serve(2)
        assert depths == [1, 2, 1, 0]
        assert waits == [("m", "served"), ("m", "served")]
        await room.close()

    asyncio.run(main())
