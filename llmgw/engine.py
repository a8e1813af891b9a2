"""The llama.cpp engine as the node agent runs it: command line, process, readiness, stopping.

The engine is llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``).
Facts that shape this module (measured on llama-cpp-python 0.3.36):

- It has no health endpoint, and ``/v1/models`` answers before the model computes anything, so
  readiness is ``/v1/models`` answering 200 *and* a 1-token completion succeeding, for every name
  the engine serves (a bad LoRA adapter only crashes the engine on its first completion).
- One process serves several names through ``--config_file``: the first entry is loaded at
  start, and a request for another entry's ``model_alias`` closes the loaded model and loads that
  entry (weights and adapter) instead. A request for a name it does not know silently goes to the
  first entry. Requests are served one at a time.
- ``interrupt_requests`` (on by default) makes a new request cut off the one that is streaming;
  behind a gateway that would break every concurrent stream, so it is turned off.
- ``/v1/embeddings`` only works when the model was loaded with ``embedding`` on; completions
  still work with it on, so it is always on.
- There is no adapter scale setting in the server (``Llama(lora_scale=...)`` is not exposed):
  adapters are applied at 1.0.

The engine runs in its own session (process group) so that it outlives the agent: a restarted
agent adopts it instead of reloading the model.

This module must not import Django.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

STOP_GRACE_SECONDS = 10.0
LAST_OUTPUT_LINES = 15


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str


@dataclass(frozen=True)
class EngineSettings:
    """What one engine process serves, and where."""

    model_path: str
    model_alias: str
    host: str
    port: int
    context_length: int
    threads: int | None = None
    adapters: tuple[AdapterEntry, ...] = field(default_factory=tuple)

    @property
    def served_names(self) -> list[str]:
        return [self.model_alias, *(adapter.name for adapter in self.adapters)]


def _model_entry(settings: EngineSettings, alias: str, lora_path: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "model": settings.model_path,
        "model_alias": alias,
        "n_ctx": settings.context_length,
        "embedding": True,
    }
    if settings.threads is not None:
        # Prompt processing uses n_threads_batch, which defaults to every core of the machine;
        # set both, so that replicas sharing a node stay within the cores they reserved.
        entry["n_threads"] = settings.threads
        entry["n_threads_batch"] = settings.threads
    if lora_path is not None:
        entry["lora_path"] = lora_path
    return entry


def engine_config(settings: EngineSettings) -> dict[str, Any]:
    """The ``--config_file`` contents: the base model first (loaded at start), then one entry
    per adapter whose alias is the adapter's name."""
    return {
        "host": settings.host,
        "port": settings.port,
        "interrupt_requests": False,
        "models": [
            _model_entry(settings, settings.model_alias, None),
            *(_model_entry(settings, a.name, a.path) for a in settings.adapters),
        ],
    }


def engine_command(settings: EngineSettings, config_path: Path) -> list[str]:
    """The engine's argv. Without adapters everything is on the command line (easy to read in
    ``ps``); with adapters the server needs a config file, written to ``config_path`` here."""
    base = [sys.executable, "-m", "llama_cpp.server"]
    if settings.adapters:
        config_path.write_text(json.dumps(engine_config(settings), indent=2) + "\n")
        return [*base, "--config_file", str(config_path)]
    command = [
        *base,
        "--model",
        settings.model_path,
        "--model_alias",
        settings.model_alias,
        "--host",
        settings.host,
        "--port",
        str(settings.port),
        "--n_ctx",
        str(settings.context_length),
        "--embedding",
        "true",
        "--interrupt_requests",
        "false",
    ]
    if settings.threads is not None:
        command += [
            "--n_threads",
            str(settings.threads),
            "--n_threads_batch",
            str(settings.threads),
        ]
    return command


def start_engine(command: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start the engine in its own session, its output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


# -- processes ----------------------------------------------------------------------------------


def process_cmdline(pid: int) -> list[str] | None:
    """The argv of a live process, or None when there is no such process (or it is a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The state letter follows the parenthesised command name, which may itself hold ")".
    if stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] in ("Z", "X"):
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def process_alive(pid: int) -> bool:
    return process_cmdline(pid) is not None


def stop_process_group(
    pid: int, *, child: subprocess.Popen[bytes] | None = None, grace: float = STOP_GRACE_SECONDS
) -> None:
    """SIGTERM the engine's process group, wait up to ``grace`` seconds, then SIGKILL it.

    ``child`` is the Popen when this agent started the engine, so that it is reaped (an adopted
    engine is reaped by init). The group id is the engine's pid: it leads its own session.
    """
    if not _signal_group(pid, signal.SIGTERM):
        _reap(child)
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if _gone(pid, child):
            return
        time.sleep(0.05)
    _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not _gone(pid, child):
        time.sleep(0.05)


def _signal_group(pid: int, signum: int) -> bool:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Not ours to signal (a reused pid under another user): leave it alone.
        return False
    return True


def _gone(pid: int, child: subprocess.Popen[bytes] | None) -> bool:
    if child is not None:
        return child.poll() is not None
    return not process_alive(pid)


def _reap(child: subprocess.Popen[bytes] | None) -> None:
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=1)


# -- ports and readiness ---------------------------------------------------------------------


def port_is_free(host: str, port: int) -> bool:
    """Whether the engine could bind ``host:port`` now (uvicorn sets SO_REUSEADDR, so a port
    whose last connection is in TIME_WAIT counts as free, as it does for the engine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


class NotReady(Exception):
    """The engine does not (yet) serve; the message says what it answered."""


def check_ready(host: str, port: int, names: Sequence[str], *, timeout: float) -> None:
    """Raise NotReady unless /v1/models answers and every name computes one token.

    The base model's name goes last, so that the engine ends with the base model loaded (a
    request for an adapter's name reloads the model with that adapter).
    """
    base = f"http://{host}:{port}"
    try:
        models = requests.get(f"{base}/v1/models", timeout=min(timeout, 5))
    except requests.RequestException as exc:
        raise NotReady(f"/v1/models: {exc.__class__.__name__}") from None
    if models.status_code != 200:
        raise NotReady(f"/v1/models answered {models.status_code}")
    for name in [*names[1:], names[0]]:
        body = {"model": name, "prompt": "hi", "max_tokens": 1}
        try:
            answer = requests.post(f"{base}/v1/completions", json=body, timeout=timeout)
        except requests.RequestException as exc:
            raise NotReady(f"a completion for {name}: {exc.__class__.__name__}") from None
        if answer.status_code != 200:
            raise NotReady(f"a completion for {name} answered {answer.status_code}")


def last_output(log_path: Path, lines: int = LAST_OUTPUT_LINES) -> str:
    """The last lines of an engine's log, for a failure message."""
    try:
        with open(log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - 64 * 1024))
            tail = log.read().decode(errors="replace")
    except OSError:
        return "(no output)"
    kept = [line.rstrip() for line in tail.splitlines() if line.strip()][-lines:]
    return "\n".join(kept) if kept else "(no output)"
