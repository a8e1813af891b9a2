"""A full disk is an error, not a crash: `manage.py llmgw_run` (what `make run` starts) with its
whole var/ (the SQLite database, the mirror, the logs, the broker, the node's cache) on a small
tmpfs of the test's own, filled to the last byte while a client keeps asking the demo model.

While it is full: every request to the ready model is answered 200 (the gateway answers from
memory); writes are refused with 507, the path and the room left, and a Retry-After, and change
nothing; the run command, the console and /metrics say the disk is full. Once the filler is
deleted, writes work again within 30 s without any process started again, the usage of every
request is written once, and SQLite's integrity check passes.

The tmpfs is mounted for the test (tests.support.tmpfs: root only, skipped otherwise) and
unmounted when it ends.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from llmgw import demo
from llmgw.engine import find_engine
from tests.support.first_run import ADMIN_PASSWORD, FirstRun
from tests.support.registry import available
from tests.support.system import wait_for
from tests.support.tmpfs import fill, free_bytes, mounted_tmpfs
from tests.support.waiting import stays

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

TMPFS_MB = 96
# What the run command is told is low: the disk is below it once the filler is in.
LOW_FREE_MB = 24
# How long the disk stays full under traffic, and what recovery may take once it has room.
FULL_SECONDS = 8
RECOVERY_SECONDS = 30


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    # Unmounted after the run command stopped: the fixture that starts it ends first.
    with mounted_tmpfs(tmp_path / "var", size_mb=TMPFS_MB) as folder:
        yield folder


METRICS_TOKEN = "full-disk-metrics-token"


@pytest.fixture
def run(tmpfs: Path, tmp_path: Path) -> Iterator[FirstRun]:
    started = FirstRun(tmpfs)
    # The run command's own output is the terminal's, not var/'s: kept off the tmpfs.
    started.log_path = tmp_path / "run.log"
    started.env["LLMGW_VAR_LOW_FREE_MB"] = str(LOW_FREE_MB)
    # Its own scrape token: one left in this process's environment by another test would keep
    # the run command from making var/metrics-token.
    started.env.pop("LLMGW_METRICS_OPEN", None)
    started.env["LLMGW_METRICS_TOKEN"] = METRICS_TOKEN
    try:
        started.start()
        yield started
    except BaseException:
        print(started.log()[-8000:])
        raise
    finally:
        started.stop()


class Traffic:
    """One client asking the demo model again and again through the gateway, keeping every
    status (and the text of any answer that was not 200)."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {key}"}
        self.statuses: list[int] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ask, daemon=True)

    def _ask(self) -> None:
        body = {"model": demo.DEMO_MODEL, "prompt": "hello", "max_tokens": 2}
        while not self._stop.is_set():
            try:
                answer = requests.post(
                    f"{self.url}/v1/completions", json=body, headers=self.headers, timeout=30
                )
                self.statuses.append(answer.status_code)
                if answer.status_code != 200:
                    self.failed.append(f"{answer.status_code} {answer.text[:300]}")
            except requests.RequestException as exc:  # every failure is a finding: kept
                self.failed.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.05)  # paces the client: about ten requests a second

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def metric(run: FirstRun, name: str) -> float | None:
    text = requests.get(
        f"{run.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
    ).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def console(run: FirstRun) -> requests.Session:
    """A browser's session, logged in as the run command's admin."""
    session = requests.Session()
    session.get(f"{run.url}/login/", timeout=10)
    answer = session.post(
        f"{run.url}/login/",
        data={
            "username": "admin",
            "password": ADMIN_PASSWORD,
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
        },
        headers={"Referer": f"{run.url}/login/"},
        timeout=10,
        allow_redirects=False,
    )
    assert answer.status_code == 302, answer.text[:500]
    return session


def post(run: FirstRun, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(
        f"{run.url}/api/v1/{path}",
        json=body,
        headers={"Authorization": f"Token {run.token}"},
        timeout=30,
    )


def spare_model(run: FirstRun) -> dict[str, Any]:
    """A second model on the demo model's file, on demand (nothing is placed for it)."""
    return {
        "name": "spare",
        "source": run.model()["definition"]["source"],
        "min_replicas": 0,
        "max_replicas": 1,
        "profiles": [{"name": "cpu", "memory_gb": 1, "cores": 1}],
    }


def test_a_full_disk_refuses_writes_keeps_answering_and_recovers_without_a_restart(
    run: FirstRun,
) -> None:
    wait_for(lambda: run.model()["ready"] >= 1, timeout=180, what="the demo model ready")
    key = post(run, "keys", {"name": "traffic"})
    assert key.status_code == 201, key.text
    browser = console(run)
    database = run.folder / "llmgw.sqlite3"
    models_before = [m["name"] for m in run.api("GET", "models")]
    keys_before = len(run.api("GET", "keys"))
    spare = spare_model(run)

    with Traffic(run.url, key.json()["key"]) as traffic:
        wait_for(lambda: len(traffic.statuses) >= 5, timeout=60, what="answers before the fill")
        filler = fill(run.folder)
        filled_at = time.monotonic()
        assert free_bytes(run.folder) < 64 * 1024

        # Writes: refused with the path and the room left, changing nothing.
        refused = post(run, "keys", {"name": "while-full"})
        assert refused.status_code == 507, refused.text
        assert refused.headers["Retry-After"] == "30"
        answer = refused.json()
        assert answer["code"] == "disk_full"
        assert answer["detail"].startswith(
            f"Nothing was changed: the disk holding the database ({database}) is full: "
        ), answer["detail"]
        assert "free of 96.00 MB" in answer["detail"]
        added = post(run, "models?source_check=false", spare)
        assert added.status_code == 507, added.text
        assert added.json()["code"] == "disk_full"
        assert [m["name"] for m in run.api("GET", "models")] == models_before
        assert len(run.api("GET", "keys")) == keys_before

        # The console: its pages still read, with the banner; a change is answered 507.
        page = browser.get(f"{run.url}/", timeout=10)
        assert page.status_code == 200
        assert "Low disk space for llmgw&#x27;s data" in page.text

        # /metrics and the run command's terminal say it.
        assert metric(run, "llmgw_var_low_free") == 1
        assert (metric(run, "llmgw_var_free_bytes") or 0) < 64 * 1024
        wait_for(
            lambda: "the disk holding llmgw's data is full" in run.log(),
            timeout=15,
            what="the run command's warning",
        )

        # The gateway answers the ready model all along.
        stays(
            lambda: not traffic.failed,
            seconds=max(0.0, FULL_SECONDS - (time.monotonic() - filled_at)),
            interval=0.5,
            what="every request answered while the disk is full",
        )
        answered_while_full = len(traffic.statuses)

        filler.unlink()
        freed_at = time.monotonic()

        def writes_again() -> bool:
            return post(run, "keys", {"name": "after"}).status_code == 201

        wait_for(writes_again, timeout=RECOVERY_SECONDS, interval=0.5, what="a key made")
        key_back = time.monotonic() - freed_at
        added = post(run, "models?source_check=false", spare)
        assert added.status_code == 201, added.text
        wait_for(
            lambda: "has room again" in run.log(),
            timeout=RECOVERY_SECONDS,
            what="the run command saying the disk has room",
        )
        assert metric(run, "llmgw_var_low_free") == 0
        page = browser.get(f"{run.url}/", timeout=10)
        assert "Low disk space" not in page.text
        wait_for(
            lambda: len(traffic.statuses) >= answered_while_full + 5,
            timeout=30,
            what="answers after the disk has room",
        )
    recovered = time.monotonic() - freed_at

    def counted() -> int:
        rows = run.api("GET", "usage")
        return sum(row["requests"] for row in rows if row["key_name"] == "traffic")

    # The usage of every request, those answered while the disk was full too: kept by the
    # gateway and written once there was room, each once.
    wait_for(
        lambda: counted() == len(traffic.statuses),
        timeout=30,
        interval=0.5,
        what=f"{len(traffic.statuses)} requests in the key's usage",
    )
    assert traffic.failed == []
    assert set(traffic.statuses) == {200}
    log = run.log()
    # Nothing was started again, and no request was a 500.
    assert "exited with code" not in log, log[-4000:]
    assert "status=500" not in log
    assert not list(run.folder.glob("**/*.part"))
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    print(
        f"\nfull-disk figures: {len(traffic.statuses)} requests, all 200 "
        f"({answered_while_full} by the time space was freed); a key made "
        f"{key_back:.1f} s after space came back; recovered within {recovered:.1f} s"
    )
