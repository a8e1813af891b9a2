"""The gateway processes' shared files (gateway.boards): one writer each, read by the others."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import boards
from gateway.boards import RESCAN_SECONDS, Board

ROOT = Path(__file__).resolve().parents[2]
SIZE = 64  # eight int64 words

# A gateway process of its own: writes 7 in its board's first word, then for each line it is
# sent answers with what it reads of the others' first words; at the end of its input, it
# closes its board (or, sent SIGKILL first, leaves it behind).
WRITER = """
import sys
from pathlib import Path
from gateway.boards import Board

board = Board(Path(sys.argv[1]), "test", 64, layout=1, fmt="q")
board.body[0] = 7
print("ready", flush=True)
for line in sys.stdin:
    board.rescan(0.0, force=True)
    print(sum(other.body[0] for other in board.others.values()), flush=True)
board.close()
"""


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    yield process
    process.kill()
    process.wait()


def board(folder: Path | None, pid: int | None = None) -> Board:
    return Board(folder, "test", SIZE, layout=1, fmt="q", pid=pid)


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_it_reads_another_processs_board_and_that_process_reads_its(
    tmp_path: Path, writer: subprocess.Popen[str]
) -> None:
    mine = board(tmp_path)
    try:
        mine.body[0] = 5
        mine.rescan(time.monotonic())
        assert {pid: other.body[0] for pid, other in mine.others.items()} == {writer.pid: 7}
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write("read\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "5\n"
        # Its end removes its file; the next look lets go of its board.
        writer.stdin.close()
        assert writer.wait(20) == 0
        assert not (tmp_path / f"test-{writer.pid}").exists()
        mine.rescan(time.monotonic(), force=True)
        assert mine.others == {}
    finally:
        mine.close()


def test_a_killed_writers_board_is_removed_and_what_it_counted_goes(
    tmp_path: Path, writer: subprocess.Popen[str]
) -> None:
    mine = board(tmp_path)
    try:
        now = time.monotonic()
        mine.rescan(now)
        assert writer.pid in mine.others
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        assert (tmp_path / f"test-{writer.pid}").exists()  # it could not remove it
        assert mine.rescan(now + RESCAN_SECONDS) == 1
        assert mine.others == {}
        assert not (tmp_path / f"test-{writer.pid}").exists()
    finally:
        mine.close()


def test_a_board_whose_pid_is_gone_or_names_another_process_now_is_removed(
    tmp_path: Path,
) -> None:
    gone = board(tmp_path, pid=dead_pid())
    reused = board(tmp_path, pid=os.getppid())
    assert reused.path is not None
    with reused.path.open("r+b") as file:  # its writer started at another time than the pid's
        magic, layout, pid, started, beat = boards.HEADER.unpack(file.read(boards.HEADER.size))
        file.seek(0)
        file.write(boards.HEADER.pack(magic, layout, pid, started + 1, beat))
    mine = board(tmp_path)
    try:
        assert mine.rescan(time.monotonic()) == 2
        assert mine.others == {}
        assert [p.name for p in tmp_path.glob("test-*")] == [f"test-{os.getpid()}"]
    finally:
        for each in (gone, reused, mine):
            each.close()


def test_a_new_writer_is_seen_at_the_next_rescan_not_before(tmp_path: Path) -> None:
    mine = board(tmp_path)
    now = time.monotonic()
    mine.rescan(now)
    newcomer = board(tmp_path, pid=os.getppid())  # another live process's board
    try:
        newcomer.body[3] = 11
        assert not mine.due(now + RESCAN_SECONDS / 2)
        mine.rescan(now + RESCAN_SECONDS / 2)
        assert mine.others == {}
        mine.rescan(now + RESCAN_SECONDS)
        assert [other.body[3] for other in mine.others.values()] == [11]
    finally:
        newcomer.close()
        mine.close()


def test_a_live_writers_board_of_another_layout_is_neither_read_nor_removed(
    tmp_path: Path,
) -> None:
    older = Board(tmp_path, "test", SIZE, layout=0, fmt="q", pid=os.getppid())
    mine = board(tmp_path)
    try:
        mine.rescan(time.monotonic())
        assert mine.others == {}
        assert older.path is not None and older.path.exists()
    finally:
        older.close()
        mine.close()


def test_close_removes_its_own_file_only_and_leaves_a_board_in_memory(tmp_path: Path) -> None:
    mine = board(tmp_path)
    assert mine.path == tmp_path / f"test-{os.getpid()}" and mine.path.exists()
    mine.close()
    assert not mine.path.exists()
    mine.body[0] += 1  # what runs after the close writes to memory of its own
    # A board made since under the same name (a later process with the same pid) stays.
    first, second = board(tmp_path), board(tmp_path)
    first.close()
    assert second.path is not None and second.path.exists()
    second.close()
    assert list(tmp_path.iterdir()) == []


def test_a_process_without_a_board_reads_every_live_one(tmp_path: Path) -> None:
    mine, other = board(tmp_path), board(tmp_path, pid=os.getppid())
    gone = board(tmp_path, pid=dead_pid())
    mine.body[0], other.body[0], gone.body[0] = 1, 2, 4
    try:
        with boards.reading(tmp_path, "test", SIZE, layout=1, fmt="q") as found:
            assert sorted(each.body[0] for each in found) == [1, 2]
        with boards.reading(tmp_path / "nowhere", "test", SIZE, layout=1) as found:
            assert found == []
    finally:
        for each in (mine, other, gone):
            each.close()


def test_a_heartbeat_is_stale_by_the_readers_own_beats_not_by_the_clock(tmp_path: Path) -> None:
    mine, other = board(tmp_path), board(tmp_path, pid=os.getppid())
    try:
        start = time.monotonic()
        mine.beat(start)
        other.beat(start)
        mine.rescan(start)
        (seen,) = mine.others.values()
        assert mine.fresh(seen, start, stale=1.0)
        # This process stops for ten seconds (so did the machine): nobody is stale for it.
        mine.beat(start + 10)
        assert mine.fresh(seen, start + 10, stale=1.0)
        # It runs for two seconds, beating, while the other does not: the other is stale.
        for step in range(1, 21):
            mine.beat(start + 10 + step * boards.PAUSE_SECONDS)
        assert not mine.fresh(seen, start + 12, stale=1.0)
        other.beat(start + 12)
        assert mine.fresh(seen, start + 12, stale=1.0)
    finally:
        other.close()
        mine.close()


def test_without_a_folder_a_board_is_memory_of_its_own() -> None:
    alone = board(None)
    alone.body[0] = 3
    assert alone.path is None and alone.rescan(0.0, force=True) == 0 and alone.others == {}
    alone.close()
