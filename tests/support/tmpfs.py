"""A small tmpfs of a test's own, to fill to the last byte: a full disk, for real.

    with mounted_tmpfs(tmp_path / "small", size_mb=4) as folder:
        ...
        fill(folder)          # the file taking every byte left; delete it to free the space

Mounting needs root (as on CI and the development machines); where it is not permitted the
test is skipped, saying why. The tmpfs is unmounted when the block ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, *, size_mb: int) -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)
        if os.path.ismount(folder):
            # Still held open by a process the test started and is stopping: let go lazily.
            subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path, name: str = "filler") -> Path:
    """A file in `folder` taking every byte left on its filesystem."""
    filler = folder / name
    chunk = b"\0" * (1 << 20)
    with filler.open("wb", buffering=0) as out:
        while chunk:
            try:
                out.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                chunk = chunk[: len(chunk) // 2]  # the last blocks, in smaller and smaller writes
    return filler


def free_bytes(folder: Path) -> int:
    found = os.statvfs(folder)
    return found.f_bavail * found.f_frsize
