"""The blob cache: the files replicas use, verified and named by their content's sha256."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from llmgw.download import BadStatus, WrongDigest, WrongSize, download_verified

# What an agent keeps under its cache folder:
# <cache>/agent.lock               one agent per cache (flock; holds the agent's pid)
# <cache>/blobs/<sha256>           verified files, named by their content's sha256
# <cache>/tmp/                     downloads in progress; emptied when an agent starts
# <cache>/urls.json                source URL -> sha256, for sources given without a sha256
# <cache>/replicas/<id>/state.json the replica's spec, engine pid, port, command, state
# <cache>/replicas/<id>/engine.log the engine's stdout and stderr

DOWNLOAD_TIMEOUT = (10, 60)
POLL_SECONDS = 0.1  # how often a waiting worker looks again (a download, a starting engine)


class FetchFailed(Exception):
    """A source could not be fetched or verified; the message is for the replica's report."""


class Cancelled(Exception):
    """The replica was stopped while its worker was busy."""


Progress = Callable[[str, int, int | None], None]


class BlobCache:
    """Verified files under ``blobs/<sha256>``; a download is written to ``tmp/`` and renamed
    into place only once complete and verified, so nothing half-written ever looks complete.

    Two replicas of one model fetch it once: downloads of one URL take turns, and the second
    finds the blob the first stored.
    """

    def __init__(self, root: Path, *, credentials: Callable[[str], dict[str, str]]) -> None:
        self.blobs = root / "blobs"
        self.tmp = root / "tmp"
        self.index_path = root / "urls.json"
        self._credentials = credentials
        self._guard = threading.Lock()
        self._url_locks: dict[str, threading.Lock] = {}

    def prepare(self) -> None:
        self.blobs.mkdir(parents=True, exist_ok=True)
        # Left by an agent that died mid-download; only one agent uses a cache (agent.lock).
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def blob(self, sha256: str) -> Path:
        return self.blobs / sha256

    def fetch(
        self,
        url: str,
        sha256: str | None,
        *,
        label: str,
        progress: Progress,
        cancelled: threading.Event,
    ) -> tuple[Path, str]:
        """The verified local file for ``url`` and its sha256, downloading it if needed."""
        found = self._cached(url, sha256)
        if found is not None:
            return found
        lock = self._url_lock(url)
        if not lock.acquire(blocking=False):
            progress(f"waiting for another replica's download of {label}", 0, None)
            while not lock.acquire(timeout=POLL_SECONDS):
                if cancelled.is_set():
                    raise Cancelled
        try:
            found = self._cached(url, sha256)
            if found is not None:
                return found
            return self._download(url, sha256, label=label, progress=progress, cancelled=cancelled)
        finally:
            lock.release()

    def _cached(self, url: str, sha256: str | None) -> tuple[Path, str] | None:
        known = sha256 or self._index().get(url)
        if known is not None and self.blob(known).is_file():
            # The modification time is the blob's last use: eviction goes oldest first.
            with contextlib.suppress(OSError):
                os.utime(self.blob(known))
            return self.blob(known), known
        return None

    def sha256_of(self, url: str, sha256: str | None) -> str | None:
        return sha256 or self._index().get(url)

    def evict(self, max_bytes: int, needed: set[str]) -> tuple[list[str], int]:
        """Delete the least recently used blobs outside ``needed`` until the blobs take at
        most ``max_bytes``; returns the evicted sha256s and the bytes the blobs take after."""
        with self._guard:
            blobs = []
            for path in self.blobs.iterdir():
                with contextlib.suppress(OSError):
                    info = path.stat()
                    blobs.append((info.st_mtime, path.name, info.st_size))
            total = sum(size for _, _, size in blobs)
            evicted = []
            for _, name, size in sorted(blobs):
                if total <= max_bytes:
                    break
                if name in needed:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    (self.blobs / name).unlink()
                total -= size
                evicted.append(name)
            if evicted:
                gone = set(evicted)
                index = self._index()
                write_json(self.index_path, {u: s for u, s in index.items() if s not in gone})
            return evicted, total

    def _url_lock(self, url: str) -> threading.Lock:
        with self._guard:
            return self._url_locks.setdefault(url, threading.Lock())

    def _download(
        self,
        url: str,
        expected: str | None,
        *,
        label: str,
        progress: Progress,
        cancelled: threading.Event,
    ) -> tuple[Path, str]:
        if urlsplit(url).scheme not in ("http", "https"):
            raise FetchFailed(f"the {label} source {url} is not an http(s) URL")

        def report(done: int, total: int | None) -> None:
            if cancelled.is_set():
                raise Cancelled
            progress(_progress_text(label, done, total), done, total)

        def store(partial: Path, sha256: str) -> None:
            with self._guard:
                # Stored and indexed at once, so that eviction never sees it unindexed.
                os.replace(partial, self.blob(sha256))
                self._remember_locked(url, sha256)

        try:
            _, actual = download_verified(
                url,
                into=self.tmp,
                place=store,
                headers=self._credentials(url),
                timeout=DOWNLOAD_TIMEOUT,
                expected_digest=expected,
                progress=report,
            )
        except BadStatus as exc:
            raise FetchFailed(
                f"could not fetch the {label} from {url}: it answered HTTP {exc.status} {exc.reason}"
            ) from None
        except WrongSize as exc:
            raise FetchFailed(
                f"the download of the {label} from {url} ended after {exc.size} of "
                f"{exc.expected} bytes"
            ) from None
        except WrongDigest as exc:
            raise FetchFailed(
                f"the file at {url} ({label}) has sha256 {exc.digest}, but {expected} was "
                "expected; the download was not kept. Either the file at the source changed or "
                "the catalog's sha256 is wrong."
            ) from None
        except requests.RequestException as exc:
            raise FetchFailed(f"could not fetch the {label} from {url}: {exc}") from None
        return self.blob(actual), actual

    def _index(self) -> dict[str, str]:
        try:
            data = json.loads(self.index_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _remember_locked(self, url: str, sha256: str) -> None:
        """Index ``url`` as ``sha256`` (the caller holds self._guard)."""
        index = self._index()
        if index.get(url) == sha256:
            return
        index[url] = sha256
        write_json(self.index_path, index)


def _progress_text(label: str, done: int, total: int | None) -> str:
    if total is None:
        return f"fetching {label}: {_megabytes(done)} MB so far"
    return f"fetching {label}: {_megabytes(done)} of {_megabytes(total)} MB"


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.1f}"


def write_json(path: Path, data: Any) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)


def write_private(path: Path, text: str) -> None:
    """Write a secret readable by this user alone: made with mode 0600 (never another mode, not
    even for a moment), through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text)
    os.replace(partial, path)
