"""A verified download: a file is written under a temporary name, hashed as it comes, checked,
and only then moved into place, so that an interrupted or corrupted download never leaves a
file that looks complete.

The mirror (registry files) and the node agent (weights and adapters) both fetch this way.
What a failure means differs between them, so the checks raise with the figures and each
caller says it in its own words. This module must not import Django: the node agent uses it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from .hashing import BackgroundHasher

CHUNK_BYTES = 1 << 20


class DownloadRefused(Exception):
    """The download was not kept; the attributes say why, for the caller's message."""


class BadStatus(DownloadRefused):
    def __init__(self, response: requests.Response) -> None:
        super().__init__(f"HTTP {response.status_code} {response.reason}")
        self.status = response.status_code
        self.reason = response.reason


class WrongSize(DownloadRefused):
    def __init__(self, size: int, expected: int) -> None:
        super().__init__(f"{size} bytes, not {expected}")
        self.size = size
        self.expected = expected


class WrongDigest(DownloadRefused):
    def __init__(self, digest: str, expected: str) -> None:
        super().__init__(f"digest {digest}, not {expected}")
        self.digest = digest
        self.expected = expected


def download_verified(
    url: str,
    *,
    into: Path,
    name: str = "",
    place: Callable[[Path, str], Any],
    get: Callable[..., requests.Response] = requests.get,
    headers: dict[str, str] | None = None,
    timeout: tuple[float, float],
    algorithm: str = "sha256",
    prefix: bytes = b"",
    expected_digest: str | None = None,
    expected_size: int | None = None,
    progress: Callable[[int, int | None], None] = lambda done, total: None,
) -> tuple[int, str]:
    """Stream ``url`` to a temporary file in the folder ``into`` (its name starts with
    ``name``), then check it and hand it to
    ``place(path, hexdigest)``, which moves it where it belongs. Returns the size and the hex
    digest (``algorithm`` over ``prefix`` and the content).

    The size is checked against ``expected_size``, else against the Content-Length the server
    sent; the digest against ``expected_digest`` when one is given. ``progress(done, total)``
    is called after each chunk (total: the size expected, None when unknown); an exception it
    raises stops the download. Whatever stops it, the temporary file is removed.
    """
    fd, temporary = tempfile.mkstemp(dir=into, prefix=name, suffix=".part")
    partial = Path(temporary)
    digest = BackgroundHasher(algorithm, prefix=prefix)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            get(url, stream=True, timeout=timeout, headers=headers) as response,
        ):
            if response.status_code != 200:
                raise BadStatus(response)
            total = expected_size
            if total is None:
                length = response.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
            done = 0
            progress(done, total)
            for chunk in response.iter_content(CHUNK_BYTES):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                progress(done, total)
            out.flush()
            os.fsync(out.fileno())
        if total is not None and done != total:
            raise WrongSize(done, total)
        [hexdigest] = digest.hexdigests()
        if expected_digest is not None and hexdigest != expected_digest:
            raise WrongDigest(hexdigest, expected_digest)
        os.chmod(partial, 0o644)
        place(partial, hexdigest)
        return done, hexdigest
    finally:
        digest.close()
        partial.unlink(missing_ok=True)
