"""A limit check takes the machine's lock only near a limit (gateway.limits.SharedCounters.admit):
far from it, what other processes may be admitting unseen cannot take a count over."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway import limits
from gateway.limits import SharedCounters, limits_of


def test_the_lock_is_taken_only_within_one_request_per_other_process_of_a_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "gateway-limits"
    key = limits_of(
        rpm=10, tpm=None, max_parallel=None, tokens_per_day=None, tokens_per_month=None,
        models=[], weight=1,
    )  # fmt: skip
    budgets = limits.no_budgets()
    mine = SharedCounters(folder, writer="a")
    # One other live process of this machine (the test's parent stands in for it).
    other = SharedCounters(folder, pid=os.getppid(), writer="b")
    locked: list[int] = []
    real_flock = limits.fcntl.flock

    def flock(handle: int, operation: int) -> None:
        if operation == limits.fcntl.LOCK_EX:
            locked.append(len(decisions))
        real_flock(handle, operation)

    monkeypatch.setattr(limits.fcntl, "flock", flock)
    decisions: list[object] = []
    try:
        assert isinstance(other.admit(1, key, None, budgets), limits.Admission)
        decisions.clear()
        locked.clear()
        for _ in range(11):
            decisions.append(mine.admit(1, key, None, budgets))
        admitted = [d for d in decisions if isinstance(d, limits.Admission)]
        assert len(admitted) == 9  # with the other process's one: exactly the 10 the limit allows
        refused = decisions[-1]
        assert isinstance(refused, limits.OverLimit) and (refused.limit, refused.used) == (
            "rpm",
            10,
        )
        # The first check reads the folder (under the lock); the next ones go without it while
        # the count is 2 or more below the limit (one other process); the last admission, at 9
        # of 10, is decided under the lock; the refusal needs none.
        assert locked == [0, 8]
    finally:
        other.close()
        mine.close()
