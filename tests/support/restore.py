"""docs/backup.md followed by a test: back up a running install as the page says (SQLite's online
backup, the secret key, the token files, the mirror), restore it into an empty folder, and start
the run command there.

    backup(first.folder, saved)            # while `first` runs
    restored = RestoredRun(folder, first)  # the same address and tokens as `first`
    restored.start(); restored.stop()

The restored run starts with --no-demo: the demo registry is demo-only state the page does not
ask to keep, and what is served comes from the restored mirror.
"""

from __future__ import annotations

import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests

from .first_run import ROOT, FirstRun
from .system import wait_for

# What docs/backup.md says to keep, besides the database, for a run whose var/ is `folder`.
KEPT_FILES = ("secret-key", "metrics-token", "local-node-token")
DATABASE = "llmgw.sqlite3"


def backup(folder: Path, into: Path) -> None:
    """The page's Python form of SQLite's online backup (the install keeps running), then the
    files and the mirror."""
    into.mkdir(parents=True)
    source = sqlite3.connect(folder / DATABASE)
    target = sqlite3.connect(into / DATABASE)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()
    for name in KEPT_FILES:
        if (folder / name).exists():
            shutil.copy2(folder / name, into / name)
    shutil.copytree(folder / "mirror", into / "mirror", symlinks=True)


def restore(saved: Path, folder: Path) -> None:
    """Into a fresh var/ folder: the database, the files and the mirror, at the same names."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(saved / DATABASE, folder / DATABASE)
    for name in KEPT_FILES:
        if (saved / name).exists():
            shutil.copy2(saved / name, folder / name)
    shutil.copytree(saved / "mirror", folder / "mirror", symlinks=True)


class RestoredRun:
    """The run command on a restored folder, at the first run's address (the mirror's file URLs
    recorded in the database are built on it) and with its token (kept hashed in the database,
    so the restored install knows it)."""

    def __init__(self, folder: Path, first: FirstRun) -> None:
        self.folder = folder
        self.url = first.url
        self.token = first.token
        self.log_path = folder / "run.log"
        self.env = {
            **first.env,
            "DATABASE_URL": f"sqlite:///{folder / DATABASE}",
            "LLMGW_VAR_DIR": str(folder),
            "LLMGW_CONFIG": str(folder / "server.yaml"),
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "llmgw_run", "--no-demo"],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_for(
            lambda: "llmgw is running" in self.log(), timeout=180, what="the restored run answering"
        )
        wait_for(lambda: self.api("GET", "models") is not None, what="the restored API")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def printed_a_new_token(self) -> bool:
        """A fresh install prints a token; a restored one finds its admin and prints none."""
        return re.search(r"LLMGW_TOKEN=\S", self.log()) is not None

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
