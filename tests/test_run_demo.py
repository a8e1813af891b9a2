"""The first run, as a newcomer meets it: `manage.py llmgw_run` (what `make run` starts) on the
embedded defaults brings up a demo registry and serves the demo model from it; `llmgw demo
publish` puts new weights there; the update check sees them; update and rollback go through.

Every process is real: olah, gunicorn, Celery worker+beat on the filesystem broker, the node
agent and its llama.cpp engine. The run command is stopped by its pid, and stops the rest.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from llmgw import demo
from llmgw.cli import main
from tests.support.registry import available
from tests.support.system import free_port, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
    ),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

ROOT = Path(__file__).resolve().parent.parent


class FirstRun:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.url = f"http://127.0.0.1:{free_port()}"
        self.registry_port = free_port()
        self.log_path = folder / "run.log"
        self.env = {
            key: value
            for key, value in os.environ.items()
            if key not in {"DATABASE_URL", "REDIS_URL", "LLMGW_CONFIG", "LLMGW_METRICS_DIR"}
        }
        self.env.update(
            DATABASE_URL=f"sqlite:///{folder / 'llmgw.sqlite3'}",
            LLMGW_VAR_DIR=str(folder),
            LLMGW_PUBLIC_URL=self.url,
            LLMGW_DEMO_REGISTRY_PORT=str(self.registry_port),
            LLMGW_CONFIG=str(folder / "server.yaml"),
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.token = ""

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "llmgw_run"],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        found = wait_for(
            lambda: re.search(r"LLMGW_TOKEN=(\S+)", self.log()), what="the run command's token"
        )
        self.token = found.group(1)
        wait_for(lambda: "llmgw is running" in self.log(), what="the run command's processes")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = requests.request(
            method,
            f"{self.url}/api/v1/{path}",
            headers={"Authorization": f"Token {self.token}"},
            timeout=30,
            **kwargs,
        )
        response.raise_for_status()
        return response.json()

    def model(self) -> dict[str, Any]:
        return self.api("GET", f"models/{demo.DEMO_MODEL}")

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FirstRun]:
    run = FirstRun(tmp_path_factory.mktemp("first-run"))
    try:
        run.start()
        yield run
    except BaseException:
        print(run.log()[-6000:])
        raise
    finally:
        run.stop()


def ctl(run: FirstRun, *argv: str, capsys: Any) -> str:
    capsys.readouterr()
    saved = {k: os.environ.get(k) for k in ("LLMGW_URL", "LLMGW_TOKEN")}
    os.environ.update(LLMGW_URL=run.url, LLMGW_TOKEN=run.token)
    try:
        code = main(["ctl", *argv])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def ready_on(run: FirstRun, commit: str) -> bool:
    model = run.model()
    return model["origin"]["commit"] == commit and model["ready"] >= 1


def test_it_serves_the_demo_model_from_its_own_registry(first_run: FirstRun) -> None:
    hub = demo.hub(first_run.folder / "demo-registry")
    first = hub.head(demo.DEMO_REPO)
    wait_for(lambda: ready_on(first_run, first), what="the demo model ready", timeout=180)
    model = first_run.model()
    assert model["origin"]["repo"] == demo.DEMO_REPO
    assert model["origin"]["branch"] == "main"
    log = first_run.log()
    assert f"Demo registry:     http://127.0.0.1:{first_run.registry_port}" in log
    assert "llmgw demo publish" in log


def test_it_publishes_an_update_that_can_be_rolled_out_and_back(
    first_run: FirstRun, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = first_run.folder / "demo-registry"
    hub = demo.hub(folder)
    first = hub.head(demo.DEMO_REPO)
    wait_for(lambda: ready_on(first_run, first), what="the demo model ready", timeout=180)

    assert main(["demo", "publish", "--folder", str(folder)]) == 0
    published = capsys.readouterr().out
    second = hub.head(demo.DEMO_REPO)
    assert second != first
    assert f"commit {second[:7]}" in published

    updates = ctl(first_run, "model", "updates", "--check", capsys=capsys)
    assert re.search(rf"{demo.DEMO_MODEL}\s+{first[:7]}\s+{second[:7]}\s+{demo.DEMO_FILE}", updates)

    ctl(first_run, "model", "update", demo.DEMO_MODEL, "--wait", capsys=capsys)
    assert ready_on(first_run, second)
    ctl(first_run, "model", "rollback", demo.DEMO_MODEL, "--wait", capsys=capsys)
    assert ready_on(first_run, first)


def test_publish_without_a_demo_registry_says_how_to_get_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "publish", "--folder", str(tmp_path / "nothing")]) == 1
    assert "make run" in capsys.readouterr().out


def test_the_run_command_stops_everything_it_started(tmp_path: Path) -> None:
    run = FirstRun(tmp_path)
    run.start()
    time.sleep(1)
    children = subprocess.run(
        ["pgrep", "-P", str(run.process.pid if run.process else 0)],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(children) >= 4, run.log()  # registry, web, worker, node
    assert run.stop() == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
