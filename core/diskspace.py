"""A full disk: the room left where llmgw writes, and a write that failed for want of it.

A full disk is not a bug of the process that meets it: the database (SQLite's "database or disk
is full", PostgreSQL's "No space left on device"), a file (ENOSPC) or a log line cannot be
written, and everything that only reads goes on. `disk_full` recognises such an error wherever it
is wrapped (Django wraps the driver's), and `refusal` turns it into the answer the API, the
console and the node API give: 507 Insufficient Storage, the path and the room left, nothing
changed (the write's transaction was rolled back), and when to try again.

`var_space` is what the run command, the console's banner and /metrics say of LLMGW_VAR_DIR
against LLMGW_VAR_LOW_FREE_MB.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from core.refusals import Refused
from llmgw.units import format_bytes

# What a refused write's answer asks the client to wait before trying again (Retry-After).
RETRY_AFTER_SECONDS = 30

# SQLite's SQLITE_FULL, as Python's sqlite3 exposes it on its errors (sqlite_errorcode).
_SQLITE_FULL = 13
# PostgreSQL's disk_full condition (SQLSTATE class 53: insufficient resources).
_POSTGRES_DISK_FULL = "53100"
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = ("database or disk is full", "No space left on device", "Disk quota exceeded")


@dataclass(frozen=True)
class Room:
    """The filesystem holding `path`: bytes an ordinary process may still write there, of its
    size."""

    path: Path
    free: int
    total: int

    def text(self) -> str:
        """`/srv/llmgw/var: 12.00 MB free of 64.00 MB`."""
        return f"{self.path}: {format_bytes(self.free)} free of {format_bytes(self.total)}"


def room(path: str | os.PathLike[str]) -> Room | None:
    """The room on the filesystem holding `path` (the nearest folder above it that exists, for
    a file not made yet); None when not even that can be asked."""
    asked = Path(path)
    where = asked
    while not where.exists() and where.parent != where:
        where = where.parent
    try:
        found = os.statvfs(where)
    except OSError:
        return None
    return Room(asked, found.f_bavail * found.f_frsize, found.f_blocks * found.f_frsize)


def disk_full(exc: BaseException | None) -> BaseException | None:
    """The error in `exc`'s chain (itself, its cause, its context) that says a disk is full, or
    None when it is about something else."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return exc
        if getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL:
            return exc
        if getattr(exc, "sqlstate", None) == _POSTGRES_DISK_FULL:
            return exc
        if type(exc).__name__ in ("OperationalError", "DiskFull", "InternalError") and any(
            words in str(exc) for words in _FULL_WORDS
        ):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


@dataclass(frozen=True)
class FullDisk:
    """Where a write failed for want of room: what it was (the database, a file), its path or
    place, and the room left there when it can be measured here."""

    what: str
    where: str
    room: Room | None

    def text(self) -> str:
        if self.room is None:
            return f"{self.what} ({self.where}) is full"
        return (
            f"the disk holding {self.what} ({self.where}) is full: "
            f"{format_bytes(self.room.free)} free of {format_bytes(self.room.total)}"
        )


def where_full(exc: BaseException) -> FullDisk:
    """What could not be written, for an error disk_full recognised."""
    if isinstance(exc, OSError):
        if exc.filename:
            return FullDisk("the file", str(exc.filename), room(exc.filename))
        return FullDisk("llmgw's files", str(settings.VAR_DIR), room(settings.VAR_DIR))
    database = settings.DATABASES["default"]
    if "sqlite" in str(database["ENGINE"]):
        name = str(database["NAME"])
        return FullDisk("the database", name, room(name))
    # PostgreSQL's files are on its server: their room is not known here.
    host = database.get("HOST") or "localhost"
    return FullDisk(
        "the database server's disk", f"PostgreSQL database {database['NAME']} on {host}", None
    )


def refusal(exc: BaseException) -> Refused:
    """The answer to a request whose write met a full disk (`exc`, as disk_full found it)."""
    full = where_full(exc)
    where = (
        f"there (old files in {settings.VAR_DIR / 'log'}, models no longer served)"
        if full.room is not None
        else "on that server"  # PostgreSQL's: nothing of llmgw's is there to remove
    )
    return Refused(
        f"Nothing was changed: {full.text()}. Free some space {where}, then try again; llmgw "
        "needs no restart.",
        code="disk_full",
        status=507,
    )


def allocate(fd: int, size: int) -> None:
    """Give the file open as `fd` real blocks for its first `size` bytes (growing it to `size`
    if shorter). For files written through a memory mapping (gateway.boards, the metrics'
    files): a page of a sparse file first written through the mapping when the disk is full
    kills the process with SIGBUS; allocated beforehand, a write never needs a block, and a
    disk already full fails here, as an OSError (ENOSPC) its caller can answer."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        # A filesystem that allocates no blocks ahead: the mapping's writes allocate them.
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)


@dataclass(frozen=True)
class VarSpace:
    """LLMGW_VAR_DIR's room against LLMGW_VAR_LOW_FREE_MB."""

    room: Room
    threshold: int  # bytes; 0: never low

    @property
    def low(self) -> bool:
        return self.room.free < self.threshold

    def warning(self) -> str:
        """What the run command and the console say while it is low."""
        return (
            f"Low disk space for llmgw's data: {self.room.text()}, below "
            f"LLMGW_VAR_LOW_FREE_MB ({format_bytes(self.threshold)}). When it is full, changes "
            "(keys, models, node reports, fetches) are refused until space is freed; the "
            "gateway goes on answering."
        )


def var_space() -> VarSpace | None:
    """LLMGW_VAR_DIR's room now (one statvfs call); None when it cannot be asked."""
    found = room(settings.VAR_DIR)
    if found is None:
        return None
    return VarSpace(found, settings.LLMGW_VAR_LOW_FREE_MB * 1024 * 1024)
