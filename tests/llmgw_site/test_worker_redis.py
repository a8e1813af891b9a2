"""The Celery worker rides out a Redis restart, even while it holds messages not yet acknowledged.

A worker holds a task due later (a countdown: the reconcile pass asked again while another holds
the lease, a change's kick) unacknowledged until it runs, and prefetched ones until it starts them.
When Redis goes away then, the worker hands them back as it closes the broken connection. Celery
5.7.0 closes that connection twice, and the second close fails (AttributeError in kombu's
`_connparams`): the worker exits with code 1 and runs nothing until something starts it again.
pyproject.toml keeps Celery below 5.7 for that; this test fails if a version that does so comes
back.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from llmgw_site.management.commands.llmgw_run import worker_command
from tests.support.redis_server import RedisServer
from tests.support.system import ROOT, wait_for

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


class Worker:
    def __init__(self, folder: Path, broker: str) -> None:
        self.log = folder / "worker.log"
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env.update(REDIS_URL=broker, LLMGW_VAR_DIR=str(folder / "var"), PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen(
            worker_command(Path(sys.executable).parent),
            cwd=ROOT,
            env=env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def test_a_worker_holding_a_task_due_later_stays_up_through_a_redis_restart(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    worker = Worker(tmp_path, redis_server.url)
    client = Celery(broker=redis_server.url)
    try:
        wait_for(lambda: " ready." in worker.text(), timeout=60, what="the worker to be ready")
        later = client.send_task("fleet.tasks.sample_capacity", countdown=300)
        wait_for(
            lambda: f"[{later.id}] received" in worker.text(),
            timeout=30,
            what="the worker to hold the task due later",
        )

        redis_server.stop()
        wait_for(
            lambda: "Connection to broker lost" in worker.text(),
            timeout=30,
            what="the worker to notice Redis gone",
        )
        # The worker closes the lost connection (handing its messages back) and only then
        # tries to connect again: its first try is past the cleanup that 5.7.0 fails in.
        wait_for(
            lambda: (
                worker.process.poll() is not None
                or "consumer: Cannot connect to" in worker.text().partition("broker lost")[2]
            ),
            timeout=30,
            what="the worker to try Redis again, or to exit",
        )
        assert worker.process.poll() is None, (
            f"the worker exited with code {worker.process.returncode} when Redis went away: "
            + "\n".join(re.findall(r".*(?:CRITICAL|Unrecoverable).*", worker.text()))[:2000]
        )

        redis_server.start()  # the same port, empty
        now = client.send_task("fleet.tasks.sample_capacity")
        wait_for(
            lambda: f"[{now.id}] received" in worker.text(),
            timeout=60,
            interval=0.5,
            what="the worker to take a task sent once Redis was back",
        )
        assert worker.process.poll() is None
    finally:
        client.close()
        worker.stop()
