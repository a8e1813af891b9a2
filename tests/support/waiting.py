"""Waits on conditions, for tests: the one place in the suite where a test's thread sleeps
between looks at what it waits for.

    wait_for(lambda: row_in_state(...), what="the replica ready")   # returns the check's value
    await wait_for_async(lambda: queue.depth("chat") == 2, what="two requests queued")
    stays(lambda: not log.exists(), seconds=1.0, what="no log written")  # time is what is tested

A wait returns as soon as its check holds (or, for `stays`, fails as soon as it stops holding)
and fails after its deadline with what it waited for and the check's last answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import requests

# The pause between two looks at a condition: short enough that a wait ends within a few
# hundredths of a second of its condition holding, long enough not to take a core from what
# the test waits on. A look that raises one of these counts as "not yet".
POLL_SECONDS = 0.02
NOT_YET: tuple[type[BaseException], ...] = (
    requests.RequestException,
    ConnectionError,
    KeyError,
    IndexError,
)


def wait_for(
    check: Callable[[], Any],
    *,
    timeout: float = 60,
    interval: float = POLL_SECONDS,
    what: str = "condition",
    not_yet: tuple[type[BaseException], ...] = NOT_YET,
) -> Any:
    """The first true value `check()` returns, looked at every `interval` s for `timeout` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except not_yet as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")
        time.sleep(interval)  # the poll interval between looks at the condition


async def wait_for_async(
    check: Callable[[], Any],
    *,
    timeout: float = 60,
    interval: float = POLL_SECONDS,
    what: str = "condition",
) -> Any:
    """wait_for on an event loop: the loop runs between looks."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)  # the poll interval between looks at the condition


def stays(
    check: Callable[[], Any],
    *,
    seconds: float,
    interval: float = POLL_SECONDS,
    what: str = "condition",
) -> None:
    """Asserts that `check()` holds at every look for `seconds` s: for what must *not* happen
    within a time, where the time itself is what is tested. Fails at the first look it fails."""
    deadline = time.monotonic() + seconds
    while True:
        last = check()
        assert last, (
            f"{what} stopped holding after {seconds - (deadline - time.monotonic()):.2f} s; last: {last!r}"
        )
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)  # the poll interval: time is what this helper tests
