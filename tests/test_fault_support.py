"""Parts the fault matrix (tests.support.faults) is made of, tried on their own: a wall clock stepped
for the processes a test starts (tests.support.stepclock), and a PostgreSQL failed over to its
standby (tests.support.postgres)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import postgres, stepclock
from tests.support.waiting import wait_for

# Prints, a line a second: the wall clock, the monotonic clock, how long a sleep of 0.2 s took,
# and the wall clock as another program (date) reads it.
CHILD = """
import json, subprocess, sys, time
for _ in range(60):
    started = time.monotonic()
    time.sleep(0.2)  # time is what is tested: a sleep must still work under the stepped clock
    slept = time.monotonic() - started
    date = int(subprocess.run(["date", "+%s"], capture_output=True, text=True).stdout)
    print(json.dumps([time.time(), time.monotonic(), slept, date]), flush=True)
    if sys.stdin.readline().strip() == "stop":
        break
"""


@pytest.mark.skipif(stepclock.unavailable() is not None, reason=str(stepclock.unavailable()))
def test_a_stepped_clock_moves_the_wall_clock_only(tmp_path: Path) -> None:
    library = stepclock.build(tmp_path)
    clock = tmp_path / "clock.rc"
    stepclock.set_offset(clock, 0)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env={"PATH": "/usr/bin:/bin", **stepclock.environment(library, clock)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None

    def look() -> list[float]:
        child.stdin.write("\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        return json.loads(child.stdout.readline())  # type: ignore[union-attr]

    try:
        wall, monotonic, _slept, date = look()
        assert abs(wall - time.time()) < 2 and abs(date - time.time()) < 3
        stepclock.set_offset(clock, -300)

        # Seen within a second (the offset is read again at most once a second).
        def stepped_back() -> list[float] | None:
            seen = look()
            return seen if seen[0] < time.time() - 290 else None

        stepped = wait_for(stepped_back, timeout=10, what="the child's wall clock stepped back")
        assert abs(stepped[0] - (time.time() - 300)) < 2
        assert abs(stepped[3] - (time.time() - 300)) < 3  # a program it starts: the same clock
        assert 0 < stepped[1] - monotonic < 10  # the monotonic clock went on
        assert 0.15 < stepped[2] < 2  # sleeps are not stepped
        stepclock.set_offset(clock, 300)
        wait_for(
            lambda: look()[0] > time.time() + 290, timeout=10, what="the clock stepped forward"
        )
    finally:
        child.stdin.write("stop\n")
        child.stdin.close()
        child.wait(timeout=10)


@pytest.mark.skipif(
    not (postgres.AVAILABLE and postgres.BIN and (postgres.BIN / "pg_basebackup").exists()),
    reason="needs PostgreSQL's initdb and pg_basebackup",
)
def test_a_fail_over_keeps_what_was_committed_and_takes_writes_on_the_same_port() -> None:
    import psycopg

    server = postgres.PostgresServer()
    try:
        server.start()
        with psycopg.connect(server.admin_url, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (n int)")
            conn.execute("INSERT INTO kept VALUES (1)")
        timeline = "SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)"
        before = server.query(timeline)
        server.start_standby()
        with psycopg.connect(server.admin_url, autocommit=True) as conn:
            conn.execute("INSERT INTO kept VALUES (2)")  # after the copy: streamed to it

        server.fail_over()

        with psycopg.connect(server.admin_url, autocommit=True) as conn:
            assert conn.execute("SELECT array_agg(n ORDER BY n) FROM kept").fetchone() == ([1, 2],)
            conn.execute("INSERT INTO kept VALUES (3)")
        assert server.query("SELECT pg_is_in_recovery()") is False
        assert server.query(timeline) != before  # a promoted standby: a new timeline
        assert server.standby is None and server.data.name != "data"
    finally:
        server.close()
