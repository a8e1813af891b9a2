"""Ports for the servers a test starts, from a band of its test process's own.

A port found free by binding port 0 and closing is free only until someone else binds it: with
the suite on several processes at once (pytest-xdist), two of them could be handed one port
between the look and the server's bind, and the second server fail to start. So each test
process takes its ports from a band of its own, below Linux's ephemeral range (32768 and up,
where the kernel picks the local ports of outgoing connections and of binds to port 0):

    BANDS_LOW .. BANDS_HIGH, split evenly between the workers (PYTEST_XDIST_WORKER_COUNT);
    one process alone (no xdist) has all of it.

Within its band a process hands out ports in turn from a random place (two test runs started
side by side by hand share a band), skipping any it cannot bind now (a server of an earlier
test still on it), and goes round again at the end.
"""

from __future__ import annotations

import os
import random
import threading

from llmgw import engine

BANDS_LOW = 20000
BANDS_HIGH = 32000  # below the ephemeral range's usual start (32768)


def worker_number() -> int | None:
    """This process's number among pytest-xdist's workers (gw0 is 0), or None without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker.removeprefix("gw")) if worker.startswith("gw") else None


def band() -> tuple[int, int]:
    """This process's ports: [low, high)."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    number = worker_number() or 0
    width = (BANDS_HIGH - BANDS_LOW) // max(count, 1)
    low = BANDS_LOW + number * width
    return low, low + width


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind the port now, as the node agent asks before it gives a port
    to an engine (llmgw.engine.port_is_free)."""
    return engine.port_is_free(host, port)


class _Band:
    def __init__(self) -> None:
        self.low, self.high = band()
        self.next = random.randrange(self.low, self.high)
        self.lock = threading.Lock()

    def take(self, size: int) -> int:
        """The first port of `size` consecutive ports, each free now, none handed out lately."""
        with self.lock:
            for _ in range((self.high - self.low) // size + 1):
                if self.next + size > self.high:
                    self.next = self.low
                first = self.next
                self.next += size
                if all(is_free(port) for port in range(first, first + size)):
                    return first
        raise RuntimeError(f"no {size} free ports left in {self.low}-{self.high - 1}")


_band: _Band | None = None
_made = threading.Lock()


def _mine() -> _Band:
    global _band
    with _made:
        if _band is None:
            _band = _Band()
        return _band


def free_port() -> int:
    """A port free now, not handed out to another test process."""
    return _mine().take(1)


def port_block(size: int) -> tuple[int, int]:
    """(first, last) of `size` consecutive ports, free now: for a node agent's --port-range."""
    first = _mine().take(size)
    return first, first + size - 1
