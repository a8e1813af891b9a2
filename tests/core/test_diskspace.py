"""core.diskspace on a real full disk: a small tmpfs (tests.support.tmpfs) filled to the last
byte, SQLite and plain files written on it."""

from __future__ import annotations

import errno
import os
import pwd
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import psycopg
import pytest

from core.diskspace import disk_full, refusal, room, var_space, where_full
from tests.support import postgres
from tests.support.tmpfs import fill, mounted_tmpfs


@pytest.fixture
def small(tmp_path: Path) -> Any:
    with mounted_tmpfs(tmp_path / "small", size_mb=1) as folder:
        yield folder


def test_it_finds_sqlites_full_disk_however_wrapped(small: Path) -> None:
    database = sqlite3.connect(small / "full.sqlite3")
    database.execute("CREATE TABLE t (b BLOB)")
    with pytest.raises(sqlite3.OperationalError) as raised:
        for _ in range(100):
            database.execute("INSERT INTO t VALUES (?)", (b"x" * 65536,))
            database.commit()
    assert str(raised.value) == "database or disk is full"
    assert disk_full(raised.value) is raised.value
    try:
        raise RuntimeError("the service failed") from raised.value
    except RuntimeError as wrapped:
        assert disk_full(wrapped) is raised.value
    database.close()


def test_a_file_that_cannot_be_written_is_named_with_the_room_left(
    small: Path, settings: Any
) -> None:
    settings.VAR_DIR = small
    fill(small)
    with pytest.raises(OSError) as raised, (small / "key.txt").open("wb", buffering=0) as out:
        out.write(b"y" * 8192)
    # A write names no file: llmgw's files are named, where the settings keep them.
    full = where_full(disk_full(raised.value))  # type: ignore[arg-type]
    assert (full.what, full.where) == ("llmgw's files", str(small))
    assert full.room is not None and full.room.free == 0
    answer = refusal(raised.value)
    assert (answer.status, answer.code) == (507, "disk_full")
    assert answer.message == (
        f"Nothing was changed: the disk holding llmgw's files ({small}) is full: 0 B free of "
        f"1.00 MB. Free some space there (old files in {small / 'log'}, models no longer "
        "served), then try again; llmgw needs no restart."
    )
    # An error that names its file (as open() and os calls do): that file.
    named = OSError(errno.ENOSPC, "No space left on device", str(small / "key.txt"))
    assert where_full(named).text() == (
        f"the disk holding the file ({small / 'key.txt'}) is full: 0 B free of 1.00 MB"
    )


@pytest.mark.skipif(not postgres.AVAILABLE, reason="needs PostgreSQL's initdb")
def test_postgresqls_full_disk_is_one_too() -> None:
    """A PostgreSQL server of the test's own, with a tablespace on a 1 MB tmpfs filled by a
    table: the error its client gets when the disk is full."""
    server = postgres.PostgresServer()
    space = Path(tempfile.mkdtemp(prefix="llmgw-test-tablespace-"))
    try:
        server.start()
        with mounted_tmpfs(space, size_mb=1):
            user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
            if user is not None:
                os.chown(space, user.pw_uid, user.pw_gid)
            with psycopg.connect(server.admin_url, autocommit=True) as conn:
                conn.execute(f"CREATE TABLESPACE small LOCATION '{space}'")
                conn.execute("CREATE TABLE t (b bytea) TABLESPACE small")
                with pytest.raises(psycopg.Error) as raised:
                    for _ in range(100):  # 64 kB of random bytes (nothing to compress) a row
                        conn.execute(
                            "INSERT INTO t SELECT decode(string_agg(md5(random()::text), ''), "
                            "'hex') FROM generate_series(1, 4096)"
                        )
                assert "No space left on device" in str(raised.value), raised.value
                assert raised.value.sqlstate == "53100", raised.value.sqlstate  # disk_full
                assert disk_full(raised.value) is raised.value
                conn.execute("DROP TABLE t")
                conn.execute("DROP TABLESPACE small")
    finally:
        server.close()
        space.rmdir()


def test_other_errors_are_not_a_full_disk(small: Path) -> None:
    database = sqlite3.connect(small / "other.sqlite3")
    with pytest.raises(sqlite3.OperationalError) as raised:
        database.execute("SELECT * FROM missing")
    database.close()
    assert disk_full(raised.value) is None
    assert disk_full(PermissionError(13, "Permission denied", "/root/x")) is None
    assert disk_full(ValueError("no space")) is None
    assert disk_full(None) is None


def test_var_is_low_below_the_setting_and_the_room_is_measured(small: Path, settings: Any) -> None:
    settings.VAR_DIR = small
    settings.LLMGW_VAR_LOW_FREE_MB = 0
    space = var_space()
    assert space is not None and not space.low  # 0: never low
    settings.LLMGW_VAR_LOW_FREE_MB = 2  # more than the whole tmpfs
    space = var_space()
    assert space is not None and space.low
    assert space.room.total == 1024 * 1024
    assert space.warning().startswith(
        f"Low disk space for llmgw's data: {small}: 1.00 MB free of 1.00 MB, below "
        "LLMGW_VAR_LOW_FREE_MB (2.00 MB)."
    )
    # A path not made yet is measured on the folder that holds it.
    found = room(small / "not" / "yet")
    assert found is not None and found.total == 1024 * 1024
