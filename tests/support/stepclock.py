"""A wall clock that tests can step for the processes they start, never the machine's.

`build(folder)` compiles tests/support/stepclock.c into a library (the C compiler that builds
llama-server); `environment(library, clock_file)` is what a process needs to run on the clock that
`set_offset(clock_file, seconds)` steps: its wall clock (time.time(), datetime.now(), time(),
gettimeofday()) reads the real time plus that many seconds within a second of the step; its
monotonic clock and its sleeps do not change, as with a step by NTP.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("stepclock.c")


def compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def unavailable() -> str | None:
    """Why a clock cannot be stepped here; None when it can."""
    if compiler() is None:
        return "stepping a clock needs a C compiler (cc) to build tests/support/stepclock.c"
    return None


def build(folder: Path) -> Path:
    """The library, built into `folder`."""
    cc = compiler()
    assert cc is not None, unavailable()
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / "stepclock.so"
    result = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(library), str(SOURCE), "-ldl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"building {SOURCE.name} failed:\n{result.stderr}"
    return library


def set_offset(clock_file: Path, seconds: int) -> None:
    """Step the clock read from `clock_file` to `seconds` from the real time. Written whole, then
    moved in place: never read half-written."""
    clock_file.parent.mkdir(parents=True, exist_ok=True)
    partial = clock_file.with_name(clock_file.name + ".partial")
    partial.write_text(f"{seconds:+d}\n")
    os.replace(partial, clock_file)


def environment(library: Path, clock_file: Path) -> dict[str, str]:
    return {"LD_PRELOAD": str(library), "STEPCLOCK_FILE": str(clock_file)}
