"""Child processes released at one instant, without anyone polling: each child says it is
ready on one pipe and blocks reading another, which the test closes once all are ready (every
child's read then returns at once).

    barrier = StartBarrier(count)
    Popen([..., *barrier.child_args()], pass_fds=barrier.child_fds())
    barrier.started()          # the test's copies of the children's ends closed
    barrier.release(timeout)   # once every child is ready; AssertionError if one is not in time

In the child (CHILD_WAIT, with the two fds as its last two arguments):

    os.write(ready, b"r"); os.read(go, 1)
"""

from __future__ import annotations

import os
import select
import time

# The child's side, to paste into a `python -c` script: `go` and `ready` are its last two
# arguments.
CHILD_WAIT = """
import os as _os, sys as _sys
_go, _ready = int(_sys.argv[-2]), int(_sys.argv[-1])
_os.write(_ready, b"r")
_os.close(_ready)
_os.read(_go, 1)
"""


class StartBarrier:
    def __init__(self, count: int) -> None:
        self.count = count
        self._go_read, self._go_write = os.pipe()
        self._ready_read, self._ready_write = os.pipe()

    def child_fds(self) -> tuple[int, int]:
        return self._go_read, self._ready_write

    def child_args(self) -> list[str]:
        return [str(self._go_read), str(self._ready_write)]

    def started(self) -> None:
        """The children have their ends: the test's copies go, so that EOF means they left."""
        os.close(self._go_read)
        os.close(self._ready_write)

    def release(self, timeout: float) -> None:
        """Wait (on the pipe, not a clock's tick) until every child is ready, then let them all
        go at once."""
        deadline = time.monotonic() + timeout
        ready = 0
        try:
            while ready < self.count:
                left = deadline - time.monotonic()
                readable, _, _ = select.select([self._ready_read], [], [], max(0.0, left))
                assert readable, f"{ready} of {self.count} children ready after {timeout} s"
                got = os.read(self._ready_read, self.count)
                assert got, f"a child left before it was ready ({ready} of {self.count} were)"
                ready += len(got)
        finally:
            os.close(self._ready_read)
            os.close(self._go_write)  # every child's read returns now
