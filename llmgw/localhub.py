"""A Hugging Face-style registry on this machine: olah serving git + git-lfs repositories.

The run command starts one holding a generated demo repository, so that updates can be tried on
a first run; the tests start their own. A new commit is served at once, without a restart. This
module must not import Django: `llmgw demo publish` and the tests use it directly.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from urllib.error import URLError
from urllib.request import urlopen

GIT = [
    "git",
    "-c",
    "user.name=registry",
    "-c",
    "user.email=registry@127.0.0.1",
    "-c",
    "init.defaultBranch=main",
]
START_SECONDS = 30


class HubError(RuntimeError):
    """The local registry could not do what was asked; the message says why and what to do."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def olah_command() -> Path:
    return Path(sys.executable).parent / "olah-cli"


def unavailable() -> str | None:
    """Why a local registry cannot run here, or None when it can."""
    if shutil.which("git") is None:
        return "git is not installed (apt-get install git)"
    if shutil.which("git-lfs") is None:
        return "git-lfs is not installed (apt-get install git-lfs)"
    if not olah_command().exists():
        return "olah is not installed in this environment (pip install olah)"
    return None


class LocalHub:
    """Repositories under `folder`/mirrors/models/ORG/NAME, served by olah on 127.0.0.1."""

    def __init__(self, folder: Path, *, port: int | None = None) -> None:
        self.folder = folder
        self.repos = folder / "mirrors"
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    # -- repositories ------------------------------------------------------------------------

    def repo_path(self, repo: str) -> Path:
        return self.repos / "models" / repo

    def _git(self, where: Path, *args: str) -> str:
        result = subprocess.run(
            [*GIT, *args], cwd=where, capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise HubError(f"git {' '.join(args)} failed in {where}: {result.stderr.strip()}")
        return result.stdout.strip()

    def commit(self, repo: str, files: dict[str, Path | bytes], message: str = "new files") -> str:
        """Write `files` into the repository (creating it) and commit; returns the commit id."""
        where = self.repo_path(repo)
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
        return self.head(repo)

    def head(self, repo: str, branch: str = "main") -> str:
        return self._git(self.repo_path(repo), "rev-parse", branch)

    def commit_count(self, repo: str) -> int:
        return int(self._git(self.repo_path(repo), "rev-list", "--count", "HEAD"))

    def has(self, repo: str) -> bool:
        return (self.repo_path(repo) / ".git").exists()

    # -- the server --------------------------------------------------------------------------

    def command(self) -> list[str]:
        """The olah command line for this hub (its configuration written into `folder`)."""
        self.repos.mkdir(parents=True, exist_ok=True)
        config = self.folder / "olah.toml"
        config.write_text(
            "[basic]\n"
            f'host = "127.0.0.1"\nport = {self.port}\n'
            f'repos-path = "{self.folder / "olah-state"}"\n'
            f'mirrors-path = ["{self.repos}"]\n'
            "[accessibility]\noffline = true\n"
        )
        return [str(olah_command()), "-c", str(config)]

    def answers(self) -> bool:
        try:
            with urlopen(self.endpoint, timeout=1):
                return True
        except URLError as exc:
            # An HTTP error status means something answered.
            return getattr(exc, "code", None) is not None
        except OSError:
            return False

    def wait_until_up(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.answers():
                return
            if process.poll() is not None:
                break
            time.sleep(0.2)
        raise HubError(
            f"the local registry (olah) did not start on {self.endpoint} within "
            f"{START_SECONDS}s; see {self.folder / 'olah.log'}"
        )

    def start(self) -> LocalHub:
        # A hub started before any commit has no folder yet.
        self.folder.mkdir(parents=True, exist_ok=True)
        log = (self.folder / "olah.log").open("ab")
        self.process = subprocess.Popen(
            self.command(),
            cwd=self.folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            self.wait_until_up(self.process)
        except HubError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.stop()
