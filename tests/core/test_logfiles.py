"""Log files several processes write: rotated by size, no file past its bound, no line lost or
cut, whether the processes were started apart (uvicorn's workers) or forked from one that had
opened the file (gunicorn's, Celery's)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from core.logfiles import SharedLogFile, SharedRotatingFileHandler
from tests.support.barrier import CHILD_WAIT, StartBarrier
from tests.support.system import ROOT

BOUND = 64 * 1024
WRITERS = 2
# Each writer writes five times the bound: ten times in all.
LINES_EACH = 5 * BOUND // 100
LINE = re.compile(r"^.* writer=(\d) line=(\d{6}) (x{60})$")

# One process of the run command: Django's logging as the settings make it (LLMGW_LOG_FILE and
# the rotation settings come from the environment), then, when the barrier lets all go, lines.
WRITER = (
    """
import logging, sys
import django
django.setup()
log = logging.getLogger("llmgw.test")
"""
    + CHILD_WAIT
    + """
for number in range(int(sys.argv[2])):
    log.info("writer=%s line=%06d %s", sys.argv[1], number, "x" * 60)
"""
)


def files_of(folder: Path, name: str) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name == name or p.name.startswith(f"{name}."))


def check(folder: Path, name: str, *, writers: int, lines_each: int, kept_all: bool) -> None:
    """No file over BOUND; every line whole; each written line there once (all of them when
    the backups kept everything)."""
    seen: Counter[tuple[str, str]] = Counter()
    logs = [p for p in files_of(folder, name) if not p.name.endswith(".lock")]
    for path in logs:
        assert path.stat().st_size <= BOUND, f"{path.name} is {path.stat().st_size} bytes"
        data = path.read_bytes()
        assert data.endswith(b"\n") or not data
        for line in data.decode().splitlines():
            found = LINE.match(line)
            assert found, f"a torn line in {path.name}: {line!r}"
            seen[(found[1], found[2])] += 1
    assert all(count == 1 for count in seen.values()), "a line written twice"
    if kept_all:
        assert len(seen) == writers * lines_each
        assert len(logs) >= 10


def test_it_keeps_every_line_of_two_processes_logging_ten_times_the_bound(
    tmp_path: Path,
) -> None:
    log_file = tmp_path / "log" / "web.log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
        "DJANGO_SETTINGS_MODULE": "llmgw_site.settings",
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        "LLMGW_LOG_FILE": str(log_file),
        "LLMGW_LOG_MAX_BYTES": str(BOUND),
        "LLMGW_LOG_BACKUPS": "40",  # enough to keep every line, so that each can be counted
    }
    barrier = StartBarrier(WRITERS)
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(number), str(LINES_EACH), *barrier.child_args()],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            pass_fds=barrier.child_fds(),
        )
        for number in range(WRITERS)
    ]
    barrier.started()
    barrier.release(timeout=60)
    for writer in writers:
        _, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err.decode()
    check(log_file.parent, "web.log", writers=WRITERS, lines_each=LINES_EACH, kept_all=True)


def _write_forked(handler: logging.Handler, number: int) -> None:
    log = logging.getLogger(f"forked{number}")
    log.propagate = False
    log.addHandler(handler)
    for line in range(LINES_EACH):
        log.warning("writer=%s line=%06d %s", number, line, "x" * 60)


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_it_keeps_every_line_of_processes_forked_after_the_file_was_opened(
    tmp_path: Path,
) -> None:
    """gunicorn's master and Celery's worker open their handlers, then fork their workers."""
    handler = SharedRotatingFileHandler(tmp_path / "worker.log", max_bytes=BOUND, backups=40)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    handler.emit(logging.makeLogRecord({"msg": "writer=9 line=000000 " + "x" * 60}))
    fork = multiprocessing.get_context("fork")
    children = [fork.Process(target=_write_forked, args=(handler, n)) for n in range(WRITERS)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    handler.close()
    check(tmp_path, "worker.log", writers=WRITERS, lines_each=LINES_EACH, kept_all=False)
    lines = sum(len(p.read_bytes().splitlines()) for p in files_of(tmp_path, "worker.log"))
    assert lines == WRITERS * LINES_EACH + 1


def test_it_keeps_only_its_backups(tmp_path: Path) -> None:
    shared = SharedLogFile(tmp_path / "beat.log", max_bytes=BOUND, backups=2)
    line = b"writer=0 line=000000 " + b"x" * 60 + b"\n"
    for _ in range(10 * BOUND // len(line)):
        shared.append(line)
    shared.close()
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"beat.log", "beat.log.1", "beat.log.2", "beat.log.lock"}
    assert all((tmp_path / name).stat().st_size <= BOUND for name in names)


def test_it_follows_a_file_logrotate_moved_away(tmp_path: Path) -> None:
    path = tmp_path / "gateway.log"
    shared = SharedLogFile(path, max_bytes=0, backups=1)
    shared.append(b"before\n")
    path.rename(tmp_path / "gateway.log.old")
    shared.append(b"after\n")
    shared.close()
    assert path.read_bytes() == b"after\n"
    assert (tmp_path / "gateway.log.old").read_bytes() == b"before\n"
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)


def test_gunicorns_access_log_goes_through_it(tmp_path: Path) -> None:
    from gunicorn.config import Config

    from llmgw_site.gunicornlog import Logger

    config = Config()
    config.set("accesslog", str(tmp_path / "web-access.log"))
    logger = Logger(config)
    handlers = [h for h in logger.access_log.handlers if getattr(h, "_gunicorn", False)]
    assert [type(h) for h in handlers] == [SharedRotatingFileHandler]
    logger.access_log.info("GET /login/ 200")
    assert (tmp_path / "web-access.log").read_text() == "GET /login/ 200\n"
