"""Who holds a fetch: a worker process named so that another process of the same machine can
tell for sure that it is gone, without waiting for its lease to lapse.

A holder reads "HOST|PID-NAMESPACE|PID|START": the machine's name, the process's PID namespace
(two containers of one host may share a host name, never a namespace), its pid, and when it
started (clock ticks since boot, from /proc), which tells a pid used again by another process.
"""

from __future__ import annotations

import os
import socket
from functools import cache


@cache
def _namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _started(pid: int) -> tuple[str, str] | None:
    """(state, start time) of the process `pid` from /proc, or None when /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return ("gone", "")
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def this_process() -> str:
    """The holder name of the calling process (asked each time: a forked worker is another)."""
    return of_process(os.getpid())


def of_process(pid: int) -> str:
    """The holder name of the process `pid` of this machine."""
    started = _started(pid)
    return f"{socket.gethostname()}|{_namespace()}|{pid}|{started[1] if started else ''}"


def is_gone(holder: str) -> bool:
    """Whether the process `holder` names is known to have ended: on this machine (same host name
    and PID namespace) and no such process, or a zombie, or another process under its pid. False
    whenever it cannot be told (another machine, a name of another shape): the lease decides."""
    try:
        host, namespace, pid_text, start = holder.split("|")
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname() or namespace != _namespace() or pid <= 0:
        return False
    started = _started(pid)
    if started is None:  # no /proc here: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    state, started_at = started
    return state in ("gone", "Z", "X") or bool(start and started_at != start)
