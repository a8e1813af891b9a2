"""The coding CLIs (OpenAI's Codex, Anthropic's Claude Code) that tests drive against a gateway:
where `scripts/system-deps clis` installed them, the set-up docs/sharing.md gives each, and a run
of one that is stopped through its process group.

Each run gets a HOME of its own (the CLIs keep their settings, sessions and logs there) and an
environment made from scratch, so nothing of the machine's (an OPENAI_API_KEY, a proxy, a
~/.codex/config.toml) changes what they do. What they send elsewhere at start is turned off by
the documented settings: measured with strace on 2026-12-07, Codex 0.171 otherwise looks up
ab.chatgpt.com (analytics), chatgpt.com and api.github.com (the plugin catalogue), and Claude
Code 2.1 api.anthropic.com. A proxy that refuses everything but 127.0.0.1 is set besides, so
that a new release's new call fails here at once instead of leaving the machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.system import ROOT

__all__ = [
    "CliRun",
    "claude_environment",
    "codex_environment",
    "documented_claude",
    "find_cli",
    "run_cli",
]

SYSTEM_DEPS = ROOT / "scripts" / "system-deps"
# Nothing listens on the discard port: a request sent through this proxy is refused at once.
REFUSING_PROXY = "http://127.0.0.1:9"


def pinned_versions() -> dict[str, str]:
    """The versions scripts/system-deps pins, by its variable names (CODEX_VERSION, ...)."""
    text = SYSTEM_DEPS.read_text()
    return dict(re.findall(r"^([A-Z_]+_VERSION)=(\S+)$", text, re.MULTILINE))


def clis_folder(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """The folder scripts/system-deps installs the pinned CLIs into (the same rule as its own)."""
    versions = pinned_versions()
    cache = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME", "~")) / ".cache")
    return (
        Path(cache).expanduser()
        / "llmgw"
        / "clis"
        / f"codex-{versions['CODEX_VERSION']}-claude-code-{versions['CLAUDE_CODE_VERSION']}"
    )


def find_cli(name: str, environ: dict[str, str] | os._Environ[str] = os.environ) -> Path | None:
    """`codex` or `claude` as installed by scripts/system-deps clis; None when it is not."""
    folder = clis_folder(environ)
    executable = folder / "node_modules" / ".bin" / name
    if not (folder / ".installed").exists() or not os.access(executable, os.X_OK):
        return None
    return executable


def _base_environment(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    node = shutil.which("node")
    # codex's launcher is a Node script (`#!/usr/bin/env node`).
    path = os.pathsep.join(
        dict.fromkeys(
            [*([str(Path(node).parent)] if node else []), "/usr/local/bin", "/usr/bin", "/bin"]
        )
    )
    return {
        "HOME": str(home),
        "PATH": path,
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "CI": "true",
        "NO_COLOR": "1",
        "HTTP_PROXY": REFUSING_PROXY,
        "HTTPS_PROXY": REFUSING_PROXY,
        "http_proxy": REFUSING_PROXY,
        "https_proxy": REFUSING_PROXY,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


# The set-up docs/sharing.md gives each CLI ("Coding clients"), which the runs here use as
# written, with the gateway's address in place of the docs' and the test's key in $LLMGW_KEY.
SHARING = ROOT / "docs" / "sharing.md"
DOCS_URL = "http://127.0.0.1:8000"


def documented(client: str) -> str:
    """The block that follows `<!-- coding-client: CLIENT -->` in docs/sharing.md."""
    found = re.search(
        rf"^<!-- coding-client: {client} -->\n```\w+\n(.*?)^```", SHARING.read_text(), re.M | re.S
    )
    assert found, f"docs/sharing.md has no block marked <!-- coding-client: {client} -->"
    return found.group(1)


def codex_environment(home: Path, *, url: str, key: str) -> dict[str, str]:
    """An environment for `codex exec` whose only server is the gateway at `url`: the docs'
    config.toml, written as HOME/.codex/config.toml, and the key in LLMGW_KEY."""
    config = documented("codex")
    assert f'"{DOCS_URL}/v1"' in config and 'env_key = "LLMGW_KEY"' in config, config
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(config.replace(DOCS_URL, url))
    return {**_base_environment(home), "LLMGW_KEY": key}


def documented_claude() -> tuple[dict[str, str], list[str]]:
    """The docs' variables for Claude Code (their values as written) and its command line."""
    lines = [line.split("  #")[0].strip() for line in documented("claude").splitlines()]
    variables = dict(
        line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export ")
    )
    (command,) = [line for line in lines if line and not line.startswith("export ")]
    return variables, command.split()


def claude_environment(home: Path, *, url: str, key: str, api_key: bool = False) -> dict[str, str]:
    """An environment for `claude -p` whose only server is the gateway at `url`, from the docs'
    variables. With `api_key`, the key goes in ANTHROPIC_API_KEY (sent as x-api-key) instead of
    the docs' ANTHROPIC_AUTH_TOKEN (sent as Authorization: Bearer)."""
    variables, _command = documented_claude()
    assert variables["ANTHROPIC_BASE_URL"] == DOCS_URL, variables
    assert variables.pop("ANTHROPIC_AUTH_TOKEN") == "$LLMGW_KEY", variables
    variables["ANTHROPIC_BASE_URL"] = url
    variables["ANTHROPIC_API_KEY" if api_key else "ANTHROPIC_AUTH_TOKEN"] = key
    return {**_base_environment(home), **variables}


@dataclass(frozen=True, repr=False)
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def __str__(self) -> str:
        return (
            f"exit {self.returncode} after {self.seconds:.1f} s\n--- stdout ---\n"
            f"{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"
        )

    __repr__ = __str__  # pytest shows an assertion's message with repr()


def run_cli(argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> CliRun:
    """argv in a process group of its own, its input closed (codex exec otherwise waits to read
    more of the prompt from it); the whole group is killed by its id when it runs past `timeout`
    and once it has exited (a CLI's helpers must not outlive the test)."""
    import time

    started = time.monotonic()
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=10)
        stderr += f"\n(killed after {timeout} s)"
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    return CliRun(process.returncode, stdout, stderr, time.monotonic() - started)
