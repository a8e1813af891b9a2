"""What every engine is to the node agent: a process in its own session, its output in a log.

Whatever the engine, the agent starts it in its own session (process group) so that it outlives
the agent (a restarted agent adopts it instead of reloading the model), stops it by its group,
keeps its log bounded and quotes the log's end when it fails. Nothing here knows an engine's
command line or API: that is each backend's (llmgw.engines.base.Engine). No Django.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STOP_GRACE_SECONDS = 10.0
LAST_OUTPUT_LINES = 15
# The most of a log read at once from an offset (an engine's output since it started).
LOG_READ_MAX_BYTES = 1024 * 1024


def start_engine(
    command: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start the engine in its own session, its output appended to ``log_path``; ``env`` is
    added to this process's environment (engine_environment)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env={**os.environ, **env} if env else None,
        )


def run_bounded(
    argv: Sequence[str], *, timeout: float, max_bytes: int, stderr: bool = True
) -> tuple[int, bytes]:
    """Run a short command: (exit code, at most ``max_bytes`` of its output, with stderr
    unless told otherwise). Raises OSError when it cannot start and TimeoutExpired when it
    runs past ``timeout`` seconds (it is killed, with its process group)."""
    with subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if stderr else subprocess.DEVNULL,
        start_new_session=True,
    ) as process:
        assert process.stdout is not None
        output = bytearray()
        reader = threading.Thread(
            target=_read_bounded, args=(process.stdout, output, max_bytes), daemon=True
        )
        reader.start()
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        finally:
            reader.join(timeout=1)
    return code, bytes(output[:max_bytes])


def _read_bounded(stream: Any, into: bytearray, max_bytes: int) -> None:
    with contextlib.suppress(OSError, ValueError):
        while len(into) < max_bytes:
            chunk = stream.read1(max_bytes - len(into))
            if not chunk:
                return
            into += chunk
        # The rest is read and dropped, so that a chatty command is not blocked on a full pipe.
        while stream.read1(1 << 16):
            pass


def read_log_from(log_path: Path, offset: int, max_bytes: int = LOG_READ_MAX_BYTES) -> str:
    """At most ``max_bytes`` of a log from ``offset`` (where this engine's output starts)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            return log.read(max_bytes).decode(errors="replace")
    except OSError:
        return ""


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
    """SIGTERM the engine's process group, wait up to ``grace`` seconds, then SIGKILL it
    (at once with ``grace=0``, for an engine that no longer answers).

    ``child`` is the Popen when this agent started the engine, so that it is reaped (an adopted
    engine is reaped by init). The group id is the engine's pid: it leads its own session.
    """
    if not _signal_group(pid, signal.SIGTERM):
        _reap(child)
        return
    # A stopped engine (SIGSTOP) keeps a SIGTERM pending until it runs again.
    _signal_group(pid, signal.SIGCONT)
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


# -- ports and logs --------------------------------------------------------------------------


def port_is_free(host: str, port: int) -> bool:
    """Whether an engine could bind ``host:port`` now (engines set SO_REUSEADDR, llama-server
    among them, so a port whose last connection is in TIME_WAIT counts as free, as it does for
    the engine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def rotate_log(log_path: Path, max_bytes: int) -> bool:
    """Keep an engine's log under ``max_bytes``: past it, the log is copied to ``<log>.1``
    (replacing the one before) and emptied in place. The engine keeps its file open for
    appending, so it goes on writing at the new end; a line written between the copy and the
    emptying is lost, which a log can afford. The copy is written under a temporary name and
    renamed once the log is emptied, so whoever sees ``<log>.1`` sees it whole and the log
    already started afresh."""
    rotated = log_path.with_name(log_path.name + ".1")
    partial = log_path.with_name(log_path.name + ".1.partial")
    try:
        if log_path.stat().st_size <= max_bytes:
            return False
        shutil.copyfile(log_path, partial)
        os.truncate(log_path, 0)
        os.replace(partial, rotated)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        return False
    return True


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - 64 * 1024))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def last_output(log_path: Path, lines: int = LAST_OUTPUT_LINES) -> str:
    """The last lines of an engine's log (and of the rotated one before it), for a failure
    message."""
    tail = _tail(log_path.with_name(log_path.name + ".1")) + _tail(log_path)
    kept = [line.rstrip() for line in tail.splitlines() if line.strip()][-lines:]
    return "\n".join(kept) if kept else "(no output)"
