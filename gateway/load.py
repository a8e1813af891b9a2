"""Requests in flight per replica, shared by every gateway process on this machine.

The gateway runs as several worker processes, and a request goes to the replica
with the fewest requests in flight: counted by one process alone, two workers
would each see an idle replica and both send to the same one. So each process
writes its own counts into a small file of its own (memory-mapped, one 32-bit
counter per slot, a replica's slot chosen by a stable hash of its id), and
choosing reads every live process's file. Only the owner writes a file, so no
lock is needed; a file whose process is gone is dropped, and what it had in
flight with it (a crashed worker cannot leave a replica looking busy forever).

Two replicas whose ids hash to the same slot share a count: with 4,096 slots
and the few dozen replicas a cluster routes to, that is rare and only makes the
choice a little less even, never wrong.

Gateway processes on other machines are not seen: each machine balances its
own share, which a load balancer in front spreads evenly.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

SLOTS = 4096
COUNTER_BYTES = 4
# How often the folder is listed again for processes that started or stopped.
RESCAN_SECONDS = 1.0


def map_own_file(path: Path, size: int) -> mmap.mmap:
    """A new file of `size` zero bytes at `path`, memory-mapped for this process to write (the
    files the machine's gateway processes share: load, limits, the fair queue)."""
    with path.open("wb") as out:
        out.truncate(size)
    handle = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(handle, size)
    finally:
        os.close(handle)


def other_processes_files(folder: Path, prefix: str, own_pid: int) -> Iterator[tuple[int, Path]]:
    """(pid, path) of every other process's `PREFIX-PID` file in `folder`."""
    for path in folder.glob(f"{prefix}-*"):
        try:
            pid = int(path.name.removeprefix(f"{prefix}-"))
        except ValueError:
            continue
        if pid != own_pid:
            yield pid, path


def slot_of(replica_id: str) -> int:
    return zlib.crc32(replica_id.encode()) % SLOTS


class SharedLoad:
    """This process's counts, written where the other processes read them."""

    def __init__(self, folder: Path | None, *, pid: int | None = None) -> None:
        self.folder = folder
        self.pid = pid if pid is not None else os.getpid()
        self._mine = memoryview(bytearray(SLOTS * COUNTER_BYTES)).cast("i")
        self._others: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self._scanned_at = -RESCAN_SECONDS
        self._file: Path | None = None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self._file = folder / f"load-{self.pid}"
            self._map = map_own_file(self._file, SLOTS * COUNTER_BYTES)
            self._mine = memoryview(self._map).cast("i")

    def add(self, replica_id: str, delta: int) -> None:
        slot = slot_of(replica_id)
        self._mine[slot] = max(0, self._mine[slot] + delta)

    def mine(self, replica_id: str) -> int:
        return int(self._mine[slot_of(replica_id)])

    def total(self, replica_id: str, now: float) -> int:
        """Requests in flight on the replica, counted over every gateway process here."""
        slot = slot_of(replica_id)
        count = int(self._mine[slot])
        if self.folder is None:
            return count
        if now - self._scanned_at >= RESCAN_SECONDS:
            self._rescan(now)
        for _, view in self._others.values():
            count += view[slot]
        return count

    def _rescan(self, now: float) -> None:
        self._scanned_at = now
        assert self.folder is not None
        seen: set[int] = set()
        for pid, path in other_processes_files(self.folder, "load", self.pid):
            if not process_alive(pid):
                # Also when it was alive at the last scan: what it had in flight died with it
                # (its mapping is closed below; kept, a killed worker's requests in flight
                # would count against their replicas for good, and the fair queue would make
                # requests wait for slots that no one holds).
                _drop(path)
                continue
            seen.add(pid)
            if pid not in self._others:
                opened = _open_for_reading(path)
                if opened is not None:
                    self._others[pid] = opened
        for pid in [p for p in self._others if p not in seen]:
            view_map, view = self._others.pop(pid)
            view.release()
            view_map.close()

    def close(self) -> None:
        for view_map, view in self._others.values():
            view.release()
            view_map.close()
        self._others.clear()
        if self._file is not None:
            self._mine.release()
            self._map.close()
            _drop(self._file)
            self._file = None


def _open_for_reading(path: Path) -> tuple[mmap.mmap, memoryview] | None:
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if os.fstat(handle).st_size < SLOTS * COUNTER_BYTES:
            return None  # still being created
        view_map = mmap.mmap(handle, SLOTS * COUNTER_BYTES, prot=mmap.PROT_READ)
    finally:
        os.close(handle)
    return view_map, memoryview(view_map).cast("i")


def _drop(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
