"""The run command as a newcomer starts it (`manage.py llmgw_run`, what `make run` runs), on the
embedded defaults in a folder of its own: SQLite, the filesystem broker, the demo registry.

    run = FirstRun(tmp_path)
    run.start()         # returns once every process is up; run.token, run.url
    run.api("GET", "models")
    run.stop()          # SIGTERM to the run command, which stops what it started

Ports are free ones, so runs never clash with each other or with `make run`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests

from llmgw import demo

from .system import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
ADMIN_PASSWORD = "first-run-password-1"


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
            LLMGW_ADMIN_PASSWORD=ADMIN_PASSWORD,
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
        wait_for(
            lambda: "llmgw is running" in self.log(), timeout=180, what="the run command answering"
        )

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
