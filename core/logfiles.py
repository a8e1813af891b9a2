"""Log files that several processes append to, rotated by size without losing or cutting a line.

The run command's processes each log to var/log/NAME.log (llmgw_site.settings), and a name is
shared: gunicorn's and uvicorn's workers, Celery's pool. logging.handlers.RotatingFileHandler is
not safe there: each process rotates on its own count, two rotate the same file in turn (one
process's fresh file becomes .1 at once, and lines go to a file already renamed away).

Here (for the processes' logs and the gateway's access log, gateway.accesslog), every write is
made under an exclusive flock of FILE.lock, which a rotation takes too: a line is never cut by
another process's, and only one process rotates. Before writing, a process compares the file it
holds with the one at the path, and reopens the path when another process (or an operator's
logrotate) moved it away. The file is rotated before a line that would take it past its size,
so no file passes it (a single line longer than the size gets a file of its own).

A process that forks (gunicorn's master, Celery's worker) hands its descriptors to its children;
an flock is held by an open file, which parent and child would then share, so a child opens its
own before its first write.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from core.diskspace import disk_full, room

FILE_MODE = 0o600
# A log file that cannot be written is said on stderr at most this often (per handler).
SAY_SECONDS = 60.0


class SharedLogFile:
    """One file appended to by any number of processes, rotated at `max_bytes` (0: never, for a
    logrotate of the operator's) to FILE.1 … FILE.`backups` (the oldest goes)."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int, backups: int) -> None:
        if max_bytes < 0 or backups < 1:
            raise ValueError(f"max_bytes ({max_bytes}) ≥ 0 and backups ({backups}) ≥ 1")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._thread_lock = threading.Lock()
        self._pid: int | None = None  # the process that opened the descriptors below
        self._file: int | None = None
        self._file_id: tuple[int, int] | None = None  # its (device, inode)
        self._lock: int | None = None  # FILE.lock, whose flock guards writes and rotations

    def open(self) -> None:
        """Open (create, owner-only) the file and its lock file: a path that cannot be written
        fails here, when the process starts."""
        with self._thread_lock:
            self._open()

    def append(self, data: bytes) -> None:
        """Append `data` (whole lines) in one write, rotating first if it would pass max_bytes."""
        self.append_lines((data,))

    def append_lines(self, lines: Iterable[bytes]) -> None:
        """Append `lines` (each whole) under the lock, as few writes as the size allows: the
        file is rotated before a line that would take it past max_bytes (a batch larger than
        that is spread over files; a line longer than it gets a file of its own)."""
        with self._thread_lock:
            if self._pid != os.getpid():
                self._open()
            assert self._lock is not None
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            try:
                self._follow()
                assert self._file is not None
                size = os.fstat(self._file).st_size
                batch: list[bytes] = []
                held = 0
                for line in lines:
                    if self.max_bytes and size + held and size + held + len(line) > self.max_bytes:
                        self._write(b"".join(batch), size)
                        batch, held = [], 0
                        self._rotate()
                        size = 0
                    batch.append(line)
                    held += len(line)
                self._write(b"".join(batch), size)
            finally:
                fcntl.flock(self._lock, fcntl.LOCK_UN)

    def _write(self, data: bytes, size: int) -> None:
        """Write `data` at the end of the file, whose size is `size`. A write that fails part
        of the way (the disk filled) is taken back whole: no line is left cut in two."""
        assert self._file is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._file, view) :]
        except OSError:
            if len(view) < len(data):
                with contextlib.suppress(OSError):
                    os.ftruncate(self._file, size)
            raise

    def close(self) -> None:
        with self._thread_lock:
            self._close()

    def _open(self) -> None:
        # After a fork: the parent's descriptors are closed here, not used (see the docstring).
        self._close()
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock_path = self.path.with_name(f"{self.path.name}.lock")
        self._lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        self._pid = os.getpid()
        self._reopen()

    def _close(self) -> None:
        for fd in (self._file, self._lock):
            if fd is not None:
                os.close(fd)
        self._file = self._lock = None
        self._file_id = None
        self._pid = None

    def _follow(self) -> None:
        """Reopen the path when the file held is no longer there."""
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            self._reopen()
            return
        if (found.st_dev, found.st_ino) != self._file_id:
            self._reopen()

    def _reopen(self) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        held = os.fstat(fd)
        if held.st_mode & 0o077:
            os.fchmod(fd, FILE_MODE)  # made before, or by someone else, readable by others
        self._file, self._file_id = fd, (held.st_dev, held.st_ino)

    def _rotate(self) -> None:
        """FILE.N-1 to FILE.N (the oldest gone), …, FILE to FILE.1, and a new FILE; under the
        lock, so no other process writes or rotates meanwhile."""
        for number in range(self.backups - 1, 0, -1):
            older = self._backup(number)
            if older.exists():
                os.replace(older, self._backup(number + 1))
        if self.path.exists():
            os.replace(self.path, self._backup(1))
        self._reopen()

    def _backup(self, number: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{number}")


class SharedRotatingFileHandler(logging.Handler):
    """A logging handler writing each record as one line to a SharedLogFile: the handler for a
    file that several processes log to."""

    def __init__(
        self, filename: str | os.PathLike[str], max_bytes: int = 0, backups: int = 1
    ) -> None:
        super().__init__()
        self.file = SharedLogFile(filename, max_bytes=max_bytes, backups=backups)
        self.file.open()
        self.baseFilename = str(self.file.path)  # as logging.FileHandler names it

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            if self.dropped:
                self._resume()
            self.file.append(line.encode("utf-8", "backslashreplace"))
        except OSError as exc:
            if disk_full(exc) is None:
                self.handleError(record)
            else:
                self._drop()
        except Exception:
            self.handleError(record)

    # Lines this process could not write (the disk was full) since the last one it wrote: the
    # first is said on stderr, in one line rather than logging's traceback a line (and at most
    # once every SAY_SECONDS: a nearly full disk takes a short line now and then); once the file
    # takes a line again, the count is written there first.
    dropped = 0
    said_at: float | None = None

    def _drop(self) -> None:
        self.dropped += 1
        now = time.monotonic()
        if self.dropped == 1 and (self.said_at is None or now - self.said_at >= SAY_SECONDS):
            self.said_at = now
            found = room(self.file.path)
            figures = f" ({found.text()})" if found else ""
            _say(
                f"llmgw: cannot write to {self.file.path}: the disk is full{figures}. Its lines are "
                "left out until there is room again; the process goes on.\n"
            )

    def _resume(self) -> None:
        note = (
            f"llmgw: {self.dropped} line(s) of process {os.getpid()} were left out of "
            f"{self.file.path} while its disk was full.\n"
        )
        self.file.append(note.encode())  # raises while the disk is still full: still dropped
        self.dropped = 0

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            super().close()


def _say(text: str) -> None:
    """A line on stderr (the terminal, under the run command), if even that can be written."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(text)
        sys.stderr.flush()
