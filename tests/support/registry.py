"""A Hugging Face-compatible registry for tests: olah serving local git + git-lfs repositories.

    with LocalRegistry(tmp_path) as registry:
        commit = registry.commit("acme/tiny", {"tiny.gguf": path_or_bytes})
        registry.endpoint  # http://127.0.0.1:PORT, for huggingface_hub and server.yaml

olah listens on 127.0.0.1 and is stopped by its pid when the block exits. New commits are
served at once, without a restart.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import requests

from .system import free_port

GIT = [
    "git",
    "-c",
    "user.name=registry",
    "-c",
    "user.email=registry@127.0.0.1",
    "-c",
    "init.defaultBranch=main",
]


def available() -> str | None:
    """Why the registry cannot run here, or None when it can."""
    if shutil.which("git-lfs") is None:
        return "git-lfs is not installed (apt-get install git-lfs)"
    if shutil.which("olah-cli", path=str(Path(sys.executable).parent)) is None:
        return "olah is not installed (pip install olah)"
    return None


class LocalRegistry:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.repos = folder / "mirrors"
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def _git(self, repo: Path, *args: str) -> str:
        result = subprocess.run([*GIT, *args], cwd=repo, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"git {' '.join(args)}: {result.stderr}"
        return result.stdout.strip()

    def commit(self, repo: str, files: dict[str, Path | bytes], message: str = "new files") -> str:
        """Write `files` into the repository (creating it) and commit; returns the commit id."""
        where = self.repos / "models" / repo
        if not (where / ".git").exists():
            where.mkdir(parents=True)
            self._git(where, "init", "-q")
            self._git(where, "lfs", "install", "--local")
            self._git(where, "lfs", "track", "*.gguf")
            (where / "README.md").write_text(f"# {repo}\n")
        for name, content in files.items():
            target = where / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                target.write_bytes(content)
            else:
                shutil.copyfile(content, target)
        self._git(where, "add", "-A")
        self._git(where, "commit", "-q", "-m", message)
        return self._git(where, "rev-parse", "HEAD")

    def start(self) -> LocalRegistry:
        self.repos.mkdir(parents=True, exist_ok=True)
        config = self.folder / "olah.toml"
        config.write_text(
            "[basic]\n"
            f'host = "127.0.0.1"\nport = {self.port}\n'
            f'repos-path = "{self.folder / "olah-state"}"\n'
            f'mirrors-path = ["{self.repos}"]\n'
            "[accessibility]\noffline = true\n"
        )
        log = (self.folder / "olah.log").open("ab")
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "olah-cli"), "-c", str(config)],
            cwd=self.folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                requests.get(self.endpoint, timeout=1)
                return self
            except requests.ConnectionError:
                if self.process.poll() is not None:
                    break
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"olah did not start on {self.endpoint}; see {self.folder / 'olah.log'}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> LocalRegistry:
        return self.start()

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.stop()
