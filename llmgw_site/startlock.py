"""One start-up at a time per database, however many control planes start together.

Two or three machines of a fresh install started at the same moment all migrate, make the first
admin and apply server.yaml. Done together on one new database, two migrations create one table
twice (`pg_type_typname_nsp_index`), one runs a later migration of an app before another finished
its earlier one, and two processes that both found no admin both insert one. Under this lock the
first process does the work and the others wait, then find it done: every step is already written
to find what is there (migrate applies only what is missing, the admin command keeps an admin it
finds, the triggers are made with CREATE OR REPLACE).

PostgreSQL: a session-level advisory lock on a fixed key, taken on a connection of the lock's own
(migrate and apply_config_on_start close Django's connections as they go, which would release a
lock taken on them), and released by closing it; a process that dies releases it with its
session. SQLite: an flock on a file beside the database (one machine, several processes).

The lock is reentrant within a process: the run command holds it around migrate, which takes it
too (llmgw_site's migrate command), and around apply_config_on_start, which also takes it when a
web, worker or beat process starts alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from django.db import connections

from .private_files import FILE_MODE, sqlite_file

log = logging.getLogger("llmgw_site.startup")

# pg_advisory_lock's key: "llmgw st" as 8 bytes, a number no other application is likely to use.
ADVISORY_KEY = int.from_bytes(b"llmgw st", "big")
# How often a waiting process tries again, and after how long it says that it waits.
POLL_SECONDS = 0.1
SAY_AFTER_SECONDS = 2.0

# Per database alias: a lock held by this process's threads (reentrant), and how deep.
_local_locks: dict[str, threading.RLock] = {}
_depths: dict[str, int] = {}
_guard = threading.Lock()


def _local_lock(using: str) -> threading.RLock:
    with _guard:
        return _local_locks.setdefault(using, threading.RLock())


@contextlib.contextmanager
def startup_lock(
    using: str = "default", *, say: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Hold the database's start-up lock for the `with` block (at once when this process holds
    it already). `say` gets one line when another process has held it for a while."""
    local = _local_lock(using)
    with local:
        depth = _depths.get(using, 0)
        _depths[using] = depth + 1
        try:
            if depth:
                yield
            else:
                with _database_lock(using, say or log.info):
                    yield
        finally:
            _depths[using] = depth


@contextlib.contextmanager
def _database_lock(using: str, say: Callable[[str], None]) -> Iterator[None]:
    vendor = connections[using].vendor
    if vendor == "postgresql":
        with _advisory_lock(using, say):
            yield
    elif vendor == "sqlite":
        path = sqlite_file(connections[using].settings_dict)
        if path is None:  # in memory: no other process sees it
            yield
            return
        with _file_lock(path.with_name(f"{path.name}.start.lock"), say):
            yield
    else:
        yield


@contextlib.contextmanager
def _advisory_lock(using: str, say: Callable[[str], None]) -> Iterator[None]:
    own = connections.create_connection(using)  # not Django's: see the module's docstring
    try:
        with own.cursor() as cursor:
            _wait(lambda: _try_advisory(cursor), say)
        try:
            yield
        finally:
            with contextlib.suppress(Exception), own.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [ADVISORY_KEY])
    finally:
        own.close()  # ends the session, which releases the lock whatever happened above


def _try_advisory(cursor: object) -> bool:
    cursor.execute("SELECT pg_try_advisory_lock(%s)", [ADVISORY_KEY])  # type: ignore[attr-defined]
    return bool(cursor.fetchone()[0])  # type: ignore[attr-defined]


@contextlib.contextmanager
def _file_lock(path: Path, say: Callable[[str], None]) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:

        def take() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        _wait(take, say)
        yield
    finally:
        os.close(fd)  # releases the flock


def _wait(take: Callable[[], bool], say: Callable[[str], None]) -> None:
    """Try `take` until it succeeds, saying once that another start-up is being waited for."""
    started = time.monotonic()
    said = False
    while not take():
        if not said and time.monotonic() - started >= SAY_AFTER_SECONDS:
            say(
                "Waiting for another control plane's start-up on this database (its "
                "migrations, first admin and server.yaml) to finish…"
            )
            said = True
        time.sleep(POLL_SECONDS)
