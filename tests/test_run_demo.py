"""The first run, as a newcomer meets it: `manage.py llmgw_run` (what `make run` starts) on the
embedded defaults brings up a demo registry and serves the demo model from it; `llmgw demo
publish` puts new weights there; the update check sees them; update and rollback go through.

Every process is real: olah, gunicorn, Celery worker+beat on the filesystem broker, the node
agent and its llama.cpp engine. The run command is stopped by its pid, and stops the rest.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw import demo
from llmgw.cli import main
from llmgw.engine import find_engine
from tests.support.first_run import FirstRun
from tests.support.registry import available
from tests.support.system import wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]


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

    def started() -> list[str]:
        return subprocess.run(
            ["pgrep", "-P", str(run.process.pid if run.process else 0)],
            capture_output=True,
            text=True,
        ).stdout.split()

    children = wait_for(
        lambda: len(pids := started()) >= 4 and pids,
        timeout=30,
        what=f"the run command's registry, web, worker and node (log: {run.log_path})",
    )
    assert run.stop() == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
