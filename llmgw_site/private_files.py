"""Files only their owner may read: var/, the SQLite database, logs and every file holding a
secret (the database holds live session keys). The umask is 077 from the settings on, var/ is
made 0700 at every start, and secrets are created 0600 (write_secret), never written first
and narrowed after.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

OWNER_ONLY_UMASK = 0o077
FOLDER_MODE = 0o700
FILE_MODE = 0o600
# SQLite's companions of a database file; it creates them with the file's own mode.
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


class NotOurs(Exception):
    """A file or folder llmgw must make owner-only belongs to another account."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            f"{path} belongs to another user, so llmgw cannot make it readable by its owner "
            "alone, and it keeps secrets there. Run llmgw as that user, or point LLMGW_VAR_DIR "
            "(or DATABASE_URL) at a place of your own."
        )


def restrict(path: Path, mode: int) -> None:
    """Give `path` exactly `mode` when it has another (a no-op when it already has it)."""
    try:
        if stat.S_IMODE(path.stat().st_mode) != mode:
            path.chmod(mode)
    except PermissionError:
        raise NotOurs(path) from None


def owner_only_folder(path: Path) -> Path:
    """`path` as a folder only its owner may enter, made (with its parents) when missing."""
    path.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    restrict(path, FOLDER_MODE)
    return path


def write_secret(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by its owner alone from its first byte.

    Written to a new file beside it (created 0600, whatever the umask) and renamed over it, so
    a reader sees the old secret or the new one, never half of one or a world-readable copy.
    """
    partial = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
    _create(partial, text)
    try:
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def kept_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret kept in `path`, made by `make()` and kept there the first time.

    Two processes starting at once agree on one secret: the new file is linked into place,
    which fails when another got there first, and then theirs is the one read. A file left
    readable by others (by an earlier version) is narrowed before it is read.
    """
    if not path.exists():
        partial = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
        _create(partial, make().strip() + "\n")
        try:
            os.link(partial, path)
        except FileExistsError:
            pass
        finally:
            partial.unlink(missing_ok=True)
    restrict(path, FILE_MODE)
    return path.read_text().strip()


def _create(path: Path, text: str) -> None:
    # O_EXCL: never write into a file (or through a link) someone else put there.
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    with os.fdopen(handle, "w") as out:
        # The mode given to os.open is narrowed by the umask, never widened; set it whole.
        os.fchmod(out.fileno(), FILE_MODE)
        out.write(text)


def sqlite_file(settings_dict: dict[str, Any]) -> Path | None:
    """The file of an SQLite database's settings, or None for one kept in memory."""
    name = str(settings_dict.get("NAME") or "")
    if not name or name == ":memory:" or name.startswith("file:"):
        return None
    return Path(name)


def restrict_sqlite_database(sender: Any, connection: Any, **kwargs: Any) -> None:
    """connection_created: an SQLite database file (and its journals) owner-only.

    SQLite creates the file on the first connection with the process's umask, and a file made
    by an earlier version stays 0644; this narrows both on every new connection (a stat when
    nothing is to be done). PostgreSQL keeps its files itself.
    """
    if connection.vendor != "sqlite":
        return
    path = sqlite_file(connection.settings_dict)
    if path is None:
        return
    for candidate in (path, *(path.with_name(path.name + end) for end in SQLITE_COMPANIONS)):
        if candidate.exists():
            restrict(candidate, FILE_MODE)
