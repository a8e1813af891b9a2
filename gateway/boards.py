"""Memory-mapped files that the gateway processes of one machine share, one writer each.

A process writes its own board (`Board`: a file named NAME-PID under a folder) and reads every
other live process's board of that name: requests in flight (gateway.load), the fair queue's
waiters (gateway.fairqueue), the limits' counts (gateway.limits). Only its writer writes a
file, so nobody takes a lock to read one. A board whose writer is gone is removed by the next
process that looks, and what it counted goes with it. `map_shared` is the other kind: one file
that every process writes (gateway.prefix's table).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.diskspace import allocate

# Every board starts with this header, its writer's body after HEADER_BYTES: the magic, the
# body's layout (its module's number: a file of another layout is neither read nor removed
# while its writer lives), the writer's pid, when that process started (clock ticks since boot;
# a file whose pid now names a process started at another time is a dead writer's), and its
# heartbeat (time.monotonic(), as of its last `beat`).
HEADER = struct.Struct("<8sqqqd")
HEADER_BYTES = 64
MAGIC = b"llmgwbd1"
_HEARTBEAT = struct.Struct("<d")
_HEARTBEAT_AT = HEADER.size - _HEARTBEAT.size
# How often a board's folder is listed again for processes that started or stopped.
RESCAN_SECONDS = 1.0
# Of a gap between two of a board's own beats, the most that counts towards judging another's
# heartbeat stale (`Board.fresh`): a longer gap means this process was not running (nor,
# perhaps, was the machine), and the others could not beat either.
PAUSE_SECONDS = 0.1
# How a board's body is read: bytes (for struct), int32 or int64 words.
Format = Literal["B", "i", "q"]


@dataclass(frozen=True, slots=True)
class _Kind:
    """What a board of one module is: its files' name, its body's size, layout and format."""

    name: str
    size: int
    layout: int
    fmt: Format


class Other:
    """Another process's board, mapped for reading: `body` as its module lays it out."""

    __slots__ = ("_map", "body", "heard", "inode", "pid", "started")

    def __init__(self, pid: int, inode: int, started: int, mapped: mmap.mmap, fmt: Format) -> None:
        self.pid, self.inode, self.started = pid, inode, started
        self._map = mapped
        self.body = memoryview(mapped)[HEADER_BYTES:].cast(fmt)
        # Its heartbeat as last read, and the reader's `awake` when it last changed.
        self.heard: tuple[float, float] | None = None

    @property
    def heartbeat(self) -> float:
        return float(_HEARTBEAT.unpack_from(self._map, _HEARTBEAT_AT)[0])

    def close(self) -> None:
        # BufferError: another thread reads it still (a stop from another thread); the mapping
        # goes when that reader lets go of it.
        with contextlib.suppress(BufferError):
            self.body.release()
            self._map.close()


class Board:
    """This process's board under `folder` (in memory of its own without a folder) and the
    other live processes' boards there, found again at most every `rescan` seconds."""

    def __init__(
        self,
        folder: Path | None,
        name: str,
        size: int,
        *,
        layout: int,
        fmt: Format = "B",
        pid: int | None = None,
        rescan: float = RESCAN_SECONDS,
    ) -> None:
        self.folder = folder
        self.kind = _Kind(name, size, layout, fmt)
        self.pid = pid if pid is not None else os.getpid()
        self.every = rescan
        self.others: dict[int, Other] = {}
        self.scanned_at = -math.inf
        self.path: Path | None = None
        self._map: mmap.mmap | None = None
        self._inode = 0
        self._beat_at = time.monotonic()
        # The seconds this process has been running, as its beats tell: what the others'
        # heartbeats are judged by (`fresh`).
        self.awake = 0.0
        if folder is None:
            self.body = memoryview(bytearray(size)).cast(fmt)
            return
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{name}-{self.pid}"
        header = HEADER.pack(MAGIC, layout, self.pid, process_started(self.pid), self._beat_at)
        self._map, self._inode = _create(self.path, header, HEADER_BYTES + size)
        self.body = memoryview(self._map)[HEADER_BYTES:].cast(fmt)

    def beat(self, now: float) -> None:
        """Write this process's heartbeat (`now`, from time.monotonic())."""
        self.awake += min(max(0.0, now - self._beat_at), PAUSE_SECONDS)
        self._beat_at = now
        if self._map is not None:
            _HEARTBEAT.pack_into(self._map, _HEARTBEAT_AT, now)

    def due(self, now: float) -> bool:
        """Whether the folder is to be listed again (`rescan`)."""
        return self.folder is not None and now - self.scanned_at >= self.every

    def rescan(self, now: float, *, force: bool = False) -> int:
        """List the folder again when it is due (or `force`): map the boards of processes that
        started, let go of those that stopped, remove the files of writers that are gone.
        Returns how many files it removed."""
        if self.folder is None or not (force or self.due(now)):
            return 0
        self.scanned_at = now
        self.others, removed = _scan(self.folder, self.kind, self.pid, self.others)
        return removed

    def fresh(self, other: Other, now: float, stale: float) -> bool:
        """Whether `other` beat within the last `stale` seconds, counted in this process's own
        beats (see PAUSE_SECONDS): a machine that stops for a while makes nobody stale."""
        heartbeat = other.heartbeat
        if other.heard is None:
            # Read for the first time: as old as its clock says.
            other.heard = (heartbeat, self.awake - max(0.0, now - heartbeat))
        elif other.heard[0] != heartbeat:
            other.heard = (heartbeat, self.awake)
        return self.awake - other.heard[1] <= stale

    def close(self) -> None:
        """Let go of every board and remove this process's file. What runs after this writes
        to memory of its own and reads nobody's (a stop may come from another thread)."""
        self.folder = None
        others, self.others = self.others, {}
        for other in others.values():
            other.close()
        if self._map is not None and self.path is not None:
            body, self.body = self.body, memoryview(bytearray(self.kind.size)).cast(self.kind.fmt)
            with contextlib.suppress(BufferError):  # as in Other.close
                body.release()
                self._map.close()
            self._map = None
            _remove(self.path, self._inode)


@contextlib.contextmanager
def reading(
    folder: Path, name: str, size: int, *, layout: int, fmt: Format = "B", skip: int = -1
) -> Iterator[list[Other]]:
    """Every live writer's board of `name` under `folder` (but process `skip`'s), mapped while
    the block runs: for a process that keeps no board of its own (the web's pages)."""
    found: dict[int, Other] = {}
    try:
        if folder.is_dir():
            found, _ = _scan(folder, _Kind(name, size, layout, fmt), skip, {})
        yield list(found.values())
    finally:
        for other in found.values():
            other.close()


def map_shared(path: Path, size: int) -> mmap.mmap:
    """`path` (made if missing, grown to `size` bytes), mapped for every process to write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # Blocks allocated, not a sparse file: a first write to one of its pages through the
        # mapping on a full disk would kill the process (SIGBUS).
        allocate(handle, size)
        return mmap.mmap(handle, size)
    finally:
        os.close(handle)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_started(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot (Linux); 0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # the 22nd field; the first two are before the ")"
    except (OSError, IndexError, ValueError):
        return 0


def writer_alive(pid: int, started: int) -> bool:
    """Whether the process that wrote a board still runs: its pid exists and, where the board
    says when its writer started, that is when the process with that pid started (a pid taken
    again by another process would otherwise keep a crashed gateway's counts for ever)."""
    return process_alive(pid) and (started == 0 or started == process_started(pid))


def _create(path: Path, header: bytes, size: int) -> tuple[mmap.mmap, int]:
    """A file of `size` bytes that starts with `header`, mapped to write, and its inode. Made
    under another name first, so that a reader never finds it without its header."""
    making = path.with_name(f".{path.name}.new")
    handle = os.open(making, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        allocate(handle, size)  # as map_shared: no page left to allocate when written
        os.pwrite(handle, header, 0)
        mapped = mmap.mmap(handle, size)
        inode = os.fstat(handle).st_ino
        os.replace(making, path)
    finally:
        os.close(handle)
    return mapped, inode


def _scan(
    folder: Path, kind: _Kind, skip: int, known: dict[int, Other]
) -> tuple[dict[int, Other], int]:
    """The live boards of `kind` in `folder` (but `skip`'s), reusing those in `known`, and how
    many files of gone writers were removed; what is left of `known` is let go of."""
    found: dict[int, Other] = {}
    removed = 0
    for pid, path, inode in _files(folder, kind.name):
        if pid == skip:
            continue
        other = known.pop(pid, None)
        if other is not None and other.inode != inode:  # its pid's file is another one now
            other.close()
            other = None
        if other is None:
            other = _open(path, pid, kind)
        if not writer_alive(pid, other.started if other is not None else 0):
            # Also when it was alive at the last scan: what it counted died with it (a killed
            # worker's requests in flight would count against their replicas for good).
            if other is not None:
                other.close()
            removed += _remove(path, inode)
        elif other is not None:
            found[pid] = other
    for other in known.values():
        other.close()
    return found, removed


def _files(folder: Path, name: str) -> Iterator[tuple[int, Path, int]]:
    """(pid, path, inode) of every NAME-PID file in `folder`."""
    prefix = f"{name}-"
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            pid = entry.name.removeprefix(prefix)
            if pid != entry.name and pid.isdigit():
                yield int(pid), Path(entry.path), entry.inode()


def _open(path: Path, pid: int, kind: _Kind) -> Other | None:
    """`path` mapped for reading, or None where it is not a board of `kind`."""
    size = HEADER_BYTES + kind.size
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.fstat(handle)
        if stat.st_size < size:
            return None
        mapped = mmap.mmap(handle, size, prot=mmap.PROT_READ)
    except OSError:
        return None
    finally:
        os.close(handle)
    magic, layout, writer, started, _ = HEADER.unpack_from(mapped, 0)
    if magic != MAGIC or layout != kind.layout or writer != pid:
        mapped.close()
        return None
    return Other(pid, stat.st_ino, started, mapped, kind.fmt)


def _remove(path: Path, inode: int) -> int:
    """Remove `path` if it is still the file with `inode` (not another one made since under its
    name); 1 when it did."""
    try:
        if os.stat(path).st_ino != inode:
            return 0
        path.unlink()
    except OSError:
        return 0
    return 1
