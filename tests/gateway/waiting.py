"""Requests held in a fair queue of this process, on a file under a var folder, as a gateway
process holds them while every slot is busy: for the readers of the machine's queue (the
model page, the API) to find.

    with requests_waiting(settings.VAR_DIR / "gateway-queue", "chat", 2):
        ...  # two requests wait for chat until the block ends

The queue runs on an event loop in a thread of its own, which keeps its heartbeat fresh; the
block's end cancels the waits (as clients hanging up) and takes the file away.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from gateway.fairqueue import ClientGone, FairQueue
from gateway.routing import Balancer, Candidate
from tests.support.waiting import wait_for_async


@contextmanager
def requests_waiting(folder: Path, model: str, count: int) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    loop = asyncio.new_event_loop()
    queued = threading.Event()
    stop = asyncio.Event()
    failure: list[BaseException] = []

    async def hold() -> None:
        queue = FairQueue(folder, poll=0.005)
        replica = Candidate(
            id=f"{model}-1", model=model, state="ready", address="127.0.0.1", port=1, slots=1
        )
        balancer = Balancer()
        balancer.load.add(replica.id, 1)  # its one slot busy: every request waits

        async def wait(key_id: int) -> None:
            async with queue.turn(
                model=model,
                key_id=key_id,
                candidates=[replica],
                balancer=balancer,
                hangup=stop.wait,
                timeout=60,
                limit=1000,
            ):
                raise AssertionError("granted while the slot was busy")

        tasks = [asyncio.create_task(wait(key_id)) for key_id in range(1, count + 1)]
        try:
            # Every wait queued, or one that ended already (its error is raised below).
            await wait_for_async(
                lambda: queue.depth(model) >= count or any(t.done() for t in tasks),
                timeout=5,
                what=f"{count} requests queued for {model}",
            )
            queued.set()
            await stop.wait()
            for task in tasks:
                with suppress(ClientGone):  # the hangup ends each wait
                    await task
        except BaseException as error:
            failure.append(error)
            raise
        finally:
            queued.set()
            queue.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(hold(),), daemon=True)
    thread.start()
    try:
        assert queued.wait(10), "the requests did not queue"
        assert not failure, failure
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
