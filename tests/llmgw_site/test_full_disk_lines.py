"""What the operator reads about a full disk: the run command's line at each change of the room
on var/'s disk (SpaceWatch), and a write retried every second said once a minute in one line
(llmgw_site.logformat.FullDiskOnce), on a small tmpfs filled for real (tests.support.tmpfs)."""

from __future__ import annotations

import io
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from core.diskspace import where_full
from llmgw_site.logformat import FullDiskOnce, OneLineFormatter
from llmgw_site.management.commands.llmgw_run import SPACE_LOOK_SECONDS, SpaceWatch
from tests.support.tmpfs import fill, mounted_tmpfs


@pytest.fixture
def var(tmp_path: Path, settings: Any) -> Any:
    with mounted_tmpfs(tmp_path / "var", size_mb=4) as folder:
        settings.VAR_DIR = folder
        yield folder


def test_the_run_command_says_low_full_and_room_again_once_each(var: Path, settings: Any) -> None:
    out, err = io.StringIO(), io.StringIO()
    watch = SpaceWatch(out, err)
    settings.LLMGW_VAR_LOW_FREE_MB = 2
    watch.look(0.0)
    assert (out.getvalue(), err.getvalue()) == ("", "")  # 4 MB free: not low
    half = var / "half"
    half.write_bytes(b"\0" * (3 * 1024 * 1024))
    watch.look(1.0)  # within SPACE_LOOK_SECONDS of the last look: not looked
    assert err.getvalue() == ""
    watch.look(SPACE_LOOK_SECONDS)
    assert err.getvalue() == (
        f"WARNING: Low disk space for llmgw's data: {var}: 1.00 MB free of 4.00 MB, below "
        "LLMGW_VAR_LOW_FREE_MB (2.00 MB). When it is full, changes (keys, models, node reports, "
        "fetches) are refused until space is freed; the gateway goes on answering."
    )
    filler = fill(var)
    watch.look(2 * SPACE_LOOK_SECONDS)
    watch.look(3 * SPACE_LOOK_SECONDS)  # still full: said once
    said = err.getvalue().split("WARNING: ")
    assert len(said) == 3
    assert said[2] == (
        f"the disk holding llmgw's data is full ({var}: 0 B free of 4.00 MB): changes (keys, "
        "models, node reports, fetches) are refused with HTTP 507 until space is freed; the "
        f"gateway goes on answering. Free space there (old logs in {var / 'log'}, models no "
        "longer served); nothing needs a restart."
    )
    filler.unlink()
    half.unlink()
    watch.look(4 * SPACE_LOOK_SECONDS)
    assert (
        out.getvalue()
        == f"The disk holding llmgw's data has room again: {var}: 4.00 MB free of 4.00 MB."
    )


def test_a_write_retried_on_a_full_disk_is_one_line_once_a_minute(var: Path) -> None:
    database = sqlite3.connect(var / "retried.sqlite3")
    database.execute("CREATE TABLE t (b BLOB)")
    fill(var)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter())
    once = FullDiskOnce(every=60.0)
    handler.addFilter(once)
    logger = logging.Logger("llmgw.gateway")
    logger.addHandler(handler)
    failures = []
    for _ in range(5):  # a retry a second
        try:
            database.execute("INSERT INTO t VALUES (?)", (b"x" * 65536,))
            database.commit()
        except sqlite3.OperationalError as exc:
            failures.append(exc)
            logger.exception("gateway: could not write traffic figures; trying again later")
    logger.error("another error")  # not about a full disk: as it is
    assert len(failures) == 5
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    # Where the disk is full: the database in the settings (a sqlite3 error names no file).
    where = where_full(failures[0]).text()
    assert lines[0].endswith(
        "ERROR llmgw.gateway: gateway: could not write traffic figures; trying again later "
        f"({where}; said once a minute while so)"
    ), lines[0]
    assert lines[1].endswith("ERROR llmgw.gateway: another error")
    database.close()
