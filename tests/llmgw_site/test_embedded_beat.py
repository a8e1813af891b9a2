"""A worker run with its beat inside (`celery worker -B`, as some operators run it) stops when that
beat dies (llmgw_site.celery.WatchEmbeddedBeat), with a code a supervisor restarts on: Celery does
not start an embedded beat again, and the worker would otherwise stay up with no schedule."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw_site.celery import BEAT_DIED_EXIT_CODE
from llmgw_site.management.commands.llmgw_run import worker_command
from tests.support.redis_server import RedisServer
from tests.support.system import ROOT, wait_for

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

EMBEDDED = re.compile(r"beat: running inside the worker as process (\d+)")


def _worker_with_beat(folder: Path, broker: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = folder / "worker.log"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(REDIS_URL=broker, LLMGW_VAR_DIR=str(folder / "var"), PYTHONPATH=str(ROOT))
    argv = [*worker_command(Path(sys.executable).parent), "-B", "--scheduler",
            "llmgw_site.beat:LeaderScheduler", "--schedule", str(folder / "schedule")]  # fmt: skip
    process = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return process, log


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def test_a_worker_stops_with_a_failure_code_when_its_embedded_beat_dies(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    worker, log = _worker_with_beat(tmp_path, redis_server.url)
    try:
        text = lambda: log.read_text(errors="replace")  # noqa: E731
        found = wait_for(
            lambda: EMBEDDED.search(text()), timeout=60, what="the beat inside the worker to start"
        )
        beat = int(found.group(1))
        assert beat != worker.pid
        wait_for(lambda: " ready." in text(), timeout=60, what="the worker to be ready")

        os.kill(beat, signal.SIGKILL)

        code = wait_for(
            lambda: worker.poll(), timeout=60, what="the worker to stop after its beat died"
        )
        assert code == BEAT_DIED_EXIT_CODE, text()[-3000:]
        assert f"the beat process inside this worker (pid {beat}) exited" in text()
    finally:
        _stop(worker)


def test_a_worker_with_its_beat_alive_stays_up_and_stops_cleanly(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    worker, log = _worker_with_beat(tmp_path, redis_server.url)
    try:
        text = lambda: log.read_text(errors="replace")  # noqa: E731
        wait_for(lambda: EMBEDDED.search(text()), timeout=60, what="the beat inside the worker")
        wait_for(lambda: " ready." in text(), timeout=60, what="the worker to be ready")
        # Several of the watch's looks (one a second) find the beat alive.
        wait_for(
            lambda: text().count("Sending due task") >= 3,
            timeout=30,
            what="the embedded beat to send",
        )
        assert worker.poll() is None
        os.killpg(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, text()[-3000:]
        assert "exited (code" not in text()
    finally:
        _stop(worker)
