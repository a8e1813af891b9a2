"""A child of the run command whose output goes to a file (the demo registry's server, which
logs a line a request) has that file rotated as llmgw's own logs are: it never passes
LLMGW_LOG_MAX_BYTES, and only the newest lines are kept (llmgw_run.copy_output)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from llmgw_site.management.commands.llmgw_run import Child
from tests.support.waiting import wait_for

BOUND = 4096
LINE = b"x" * 99 + b"\n"  # 100 bytes
LINES = 10 * BOUND // len(LINE)  # ten times the bound


def test_a_childs_logged_output_is_rotated_at_the_bound(tmp_path: Path, settings: Any) -> None:
    settings.LLMGW_LOG_MAX_BYTES = BOUND
    settings.LLMGW_LOG_BACKUPS = 2
    log = tmp_path / "talker.log"
    script = (
        "import sys\n"
        f"for n in range({LINES}):\n"
        "    sys.stdout.write(f'{n:09d}' + 'x' * 90 + '\\n')\n"
        "sys.stdout.write('no newline at the end')\n"
    )
    child = Child("talker", [sys.executable, "-c", script], log=log)
    process = child.start()
    try:
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    files = [log, log.with_name("talker.log.1"), log.with_name("talker.log.2")]
    wait_for(
        lambda: log.exists() and log.read_bytes().endswith(b"no newline at the end"),
        timeout=10,
        what="the child's last words in its log",
    )
    assert not log.with_name("talker.log.3").exists()  # two backups, the oldest gone
    sizes = [f.stat().st_size for f in files]
    assert all(size <= BOUND for size in sizes), sizes
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in files)
    kept = b"".join(f.read_bytes() for f in reversed(files)).splitlines()
    numbers = [int(line[:9]) for line in kept[:-1]]
    assert numbers == list(range(numbers[0], LINES))  # the newest, in order, none lost between
    assert LINES - numbers[0] >= 2 * BOUND // len(LINE)  # more than one file's worth kept
