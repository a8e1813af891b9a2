"""`llmgw node`: the agent that runs replicas on one machine.

It is level-triggered. Every heartbeat it tells the control plane its capacity and the state of
each replica it runs, and the answer is the complete list of replicas it should run: it starts
what is missing and stops what is no longer listed. A lost message therefore changes nothing,
and a restarted agent converges on the next answer.

Each wanted replica gets a worker thread (the heartbeat loop never waits on one) that fetches
the weights and adapters into a content-addressed cache, checks the adapters against the model
(to say which one is wrong and why, before any engine loads it), starts the engine (llama.cpp's
llama-server, see llmgw.engine) and watches it: an engine that exits or stops answering /health
fails its replica, with the reason, and the control plane replaces it.

Engines run in their own session and outlive the agent: on start the agent adopts the engines
an earlier agent left running (recorded in ``<cache>/replicas/<id>/state.json``), so an agent
upgrade or crash does not reload every model. What the control plane no longer wants is
stopped after the first answer.

Cache layout::

    <cache>/agent.lock               one agent per cache (flock; holds the agent's pid)
    <cache>/blobs/<sha256>           verified files, named by their content's sha256
    <cache>/tmp/                     downloads in progress; emptied when an agent starts
    <cache>/urls.json                source URL -> sha256, for sources given without a sha256
    <cache>/replicas/<id>/state.json the replica's spec, engine pid, port, command, state
    <cache>/replicas/<id>/engine.log the engine's stdout and stderr

This module must not import Django.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import requests

from . import engine
from .gguf import GGUFError, adapter_problems, estimate_memory_bytes, read_header_from_file
from .hashing import BackgroundHasher

log = logging.getLogger("llmgw.node")

DEFAULT_PORT_RANGE = (41000, 41999)
DEFAULT_HEARTBEAT_SECONDS = 2.0
DEFAULT_READY_TIMEOUT_SECONDS = 120.0
DEFAULT_CONTEXT_LENGTH = 2048
DEFAULT_ENGINE_LOG_MAX_BYTES = 10 * 1000 * 1000
MAX_SLOTS = 256
DOWNLOAD_CHUNK_BYTES = 1 << 20
HEARTBEAT_TIMEOUT = (5, 10)  # (connect, read) seconds
DOWNLOAD_TIMEOUT = (10, 60)
WATCH_SECONDS = 0.5  # how often a worker looks at its engine once it is ready
# A ready engine is probed every second; three probes in a row without an answer within a
# second fail the replica: a hung engine is reported within about 6 s (and withdrawn from
# routing with that report), while a busy one still answers /health in about a millisecond.
HEALTH_INTERVAL_SECONDS = 1.0
HEALTH_TIMEOUT_SECONDS = 1.0
HEALTH_MISSES = 3
METRICS_INTERVAL_SECONDS = 5.0
POLL_SECONDS = 0.1  # how often a worker probes a starting engine

_SHA256 = re.compile(r"[0-9a-f]{64}")
# A replica id becomes a folder name: no separators, no "." or "..".
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _agent_version() -> str:
    try:
        from importlib.metadata import version

        return version("llmgw")
    except Exception:
        return "0.1.0"


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.1f}"


# -- what the control plane asks for ------------------------------------------------------------


class AnswerError(Exception):
    """The control plane's answer is not something this agent understands."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    source: str
    sha256: str | None
    scale: float


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica as the control plane describes it; an id never changes its spec."""

    id: str
    model: str
    source: str
    sha256: str | None
    adapters: tuple[AdapterSpec, ...]
    context_length: int | None
    threads: int | None
    slots: int = 1  # requests the engine serves at once

    @classmethod
    def from_json(cls, data: Any) -> ReplicaSpec:
        if not isinstance(data, dict):
            raise AnswerError(f"a replica is {type(data).__name__}, not an object")
        replica_id = data.get("id")
        if not isinstance(replica_id, str) or not _REPLICA_ID.fullmatch(replica_id):
            raise AnswerError(f"a replica's id is {replica_id!r}, not a usable id")
        where = f"replica {replica_id}"
        adapters = data.get("adapters") or []
        if not isinstance(adapters, list):
            raise AnswerError(f"{where}: adapters is not a list")
        return cls(
            id=replica_id,
            model=_text(data, "model", where),
            source=_text(data, "source", where),
            sha256=_sha256(data.get("sha256"), where),
            adapters=tuple(_adapter(item, where) for item in adapters),
            context_length=_positive_int(data.get("context_length"), "context_length", where),
            # 0 threads means "no cores reserved": the engine's own default applies.
            threads=_positive_int(data.get("threads"), "threads", where) or None,
            slots=min(_positive_int(data.get("slots"), "slots", where) or 1, MAX_SLOTS),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "source": self.source,
            "sha256": self.sha256,
            "adapters": [
                {"name": a.name, "source": a.source, "sha256": a.sha256, "scale": a.scale}
                for a in self.adapters
            ],
            "context_length": self.context_length,
            "threads": self.threads,
            "slots": self.slots,
        }


def _text(data: dict[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise AnswerError(f"{where}: {key} is {value!r}, not a non-empty string")
    return value


def _sha256(value: Any, where: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not _SHA256.fullmatch(value.lower()):
        raise AnswerError(f"{where}: {value!r} is not a sha256 (64 hex digits)")
    return value.lower()


def _positive_int(value: Any, key: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AnswerError(f"{where}: {key} is {value!r}, not a whole number >= 0")
    return value


def _adapter(data: Any, where: str) -> AdapterSpec:
    if not isinstance(data, dict):
        raise AnswerError(f"{where}: an adapter is {type(data).__name__}, not an object")
    scale = data.get("scale", 1.0)
    if scale is None:
        scale = 1.0
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise AnswerError(f"{where}: an adapter's scale is {scale!r}, not a number")
    name = _text(data, "name", where)
    return AdapterSpec(
        name=name,
        source=_text(data, "source", f"{where}, adapter {name}"),
        sha256=_sha256(data.get("sha256"), f"{where}, adapter {name}"),
        scale=float(scale),
    )


@dataclass(frozen=True)
class Answer:
    replicas: list[ReplicaSpec]
    interval: float | None
    # Files to keep in the cache though no replica here uses them now: the previous revisions
    # of the models this node runs, which a rollback would start again. (source, sha256)
    keep: tuple[tuple[str, str | None], ...] = ()


def parse_answer(body: Any) -> Answer:
    """The wanted replicas, the heartbeat interval and the files to keep, from a 200 answer;
    AnswerError if the answer is malformed anywhere (then nothing changes: a half-understood
    answer must not stop replicas)."""
    if not isinstance(body, dict):
        raise AnswerError(f"the answer is {type(body).__name__}, not an object")
    replicas = body.get("replicas")
    if not isinstance(replicas, list):
        raise AnswerError("the answer has no list of replicas")
    specs = [ReplicaSpec.from_json(item) for item in replicas]
    ids = [spec.id for spec in specs]
    if len(set(ids)) != len(ids):
        raise AnswerError("the answer lists one replica id twice")
    interval = body.get("heartbeat_interval")
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
        interval = None
    keep = body.get("keep") or []
    if not isinstance(keep, list):
        raise AnswerError("the answer's keep is not a list")
    kept = tuple(
        (_text(item, "source", "a kept file"), _sha256(item.get("sha256"), "a kept file"))
        for item in keep
        if isinstance(item, dict)
    )
    return Answer(specs, interval, kept)


# -- the blob cache -----------------------------------------------------------------------------


class FetchFailed(Exception):
    """A source could not be fetched or verified; the message is for the replica's report."""


class Cancelled(Exception):
    """The replica was stopped while its worker was busy."""


class ReplicaFailed(Exception):
    """Raised inside a worker to fail its replica with this message."""


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
                _write_json(self.index_path, {u: s for u, s in index.items() if s not in gone})
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
        fd, name = tempfile.mkstemp(dir=self.tmp, suffix=".part")
        partial = Path(name)
        digest = BackgroundHasher("sha256")
        try:
            with (
                os.fdopen(fd, "wb") as out,
                requests.get(
                    url, stream=True, timeout=DOWNLOAD_TIMEOUT, headers=self._credentials(url)
                ) as response,
            ):
                if response.status_code != 200:
                    raise FetchFailed(
                        f"could not fetch the {label} from {url}: it answered "
                        f"HTTP {response.status_code} {response.reason}"
                    )
                length = response.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
                done = 0
                progress(_progress_text(label, done, total), done, total)
                for chunk in response.iter_content(DOWNLOAD_CHUNK_BYTES):
                    if cancelled.is_set():
                        raise Cancelled
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    progress(_progress_text(label, done, total), done, total)
                out.flush()
                os.fsync(out.fileno())
            if total is not None and done != total:
                raise FetchFailed(
                    f"the download of the {label} from {url} ended after {done} of {total} bytes"
                )
            [actual] = digest.hexdigests()
            if expected is not None and actual != expected:
                raise FetchFailed(
                    f"the file at {url} ({label}) has sha256 {actual}, but {expected} was "
                    "expected; "
                    "the download was not kept. Either the file at the source changed or the "
                    "catalog's sha256 is wrong."
                )
            os.chmod(partial, 0o644)
            with self._guard:
                # Stored and indexed at once, so that eviction never sees it unindexed.
                os.replace(partial, self.blob(actual))
                self._remember_locked(url, actual)
            return self.blob(actual), actual
        except requests.RequestException as exc:
            raise FetchFailed(f"could not fetch the {label} from {url}: {exc}") from None
        finally:
            digest.close()
            partial.unlink(missing_ok=True)

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
        _write_json(self.index_path, index)


def _progress_text(label: str, done: int, total: int | None) -> str:
    if total is None:
        return f"fetching {label}: {_megabytes(done)} MB so far"
    return f"fetching {label}: {_megabytes(done)} of {_megabytes(total)} MB"


def _write_json(path: Path, data: Any) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)


# -- one replica --------------------------------------------------------------------------------


class Replica:
    """One wanted replica: its worker thread, its engine, and what the heartbeat reports."""

    def __init__(self, agent: Agent, spec: ReplicaSpec) -> None:
        self.agent = agent
        self.spec = spec
        self.folder = agent.replicas_dir / spec.id
        self.lock = threading.Lock()
        self.stop_requested = threading.Event()
        self.state = "fetching"
        self.message = "waiting to fetch"
        self.progress: dict[str, int | None] | None = None
        self.port: int | None = None
        self.sha256: str | None = None  # known once the weights are fetched and verified
        self.host = agent.config.address  # where the engine listens (an adopted one: as recorded)
        self.pid: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.command: list[str] | None = None
        self.started_at: str | None = None
        self.thread: threading.Thread | None = None
        self.engine_metrics: dict[str, float] | None = None  # the engine's /metrics, if read
        self._metrics_read: tuple[float, dict[str, float]] | None = None

    @property
    def label(self) -> str:
        return f"replica {self.spec.id} ({self.spec.model})"

    def report(self) -> dict[str, Any]:
        with self.lock:
            return {
                "id": self.spec.id,
                "state": self.state,
                "port": self.port,
                "message": self.message,
                "progress": dict(self.progress) if self.progress is not None else None,
                "sha256": self.sha256,
                "slots": self.spec.slots,
                "engine": dict(self.engine_metrics) if self.engine_metrics else None,
            }

    def start(self, work: Callable[[], None]) -> None:
        self.thread = threading.Thread(
            target=self._guarded, args=(work,), name=f"replica-{self.spec.id}", daemon=True
        )
        self.thread.start()

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Cancelled:
            pass
        except (ReplicaFailed, FetchFailed) as exc:
            self._fail(str(exc))
        except Exception as exc:
            # A bug must fail this replica, not kill the agent or leave it "starting" forever.
            log.exception("%s: unexpected error", self.label)
            self._kill_engine()
            self._fail(f"the agent hit an unexpected error: {exc!r}; see the agent's log")

    # -- state changes --------------------------------------------------------------------------

    def _set(self, state: str, message: str) -> None:
        with self.lock:
            if self.stop_requested.is_set():
                return
            changed = state != self.state
            self.state, self.message, self.progress = state, message, None
        if changed:
            log.info("%s: %s: %s", self.label, state, message)
            # A state change is worth telling the control plane now, not at the next beat.
            self.agent.wake.set()

    def _on_progress(self, message: str, done: int, total: int | None) -> None:
        with self.lock:
            if not self.stop_requested.is_set():
                self.message, self.progress = message, {"done": done, "total": total}

    def _fail(self, message: str) -> None:
        with self.lock:
            if self.stop_requested.is_set():
                return
            self.state, self.message, self.progress = "failed", message, None
            self.pid, self.process = None, None
            self._persist_locked()
        log.warning("%s: failed: %s", self.label, message)
        self.agent.wake.set()

    def _persist_locked(self) -> None:
        """Write state.json (caller holds self.lock). Never after a stop: the folder is gone."""
        if self.stop_requested.is_set():
            return
        _write_json(
            self.folder / "state.json",
            {
                "id": self.spec.id,
                "spec": self.spec.to_json(),
                "state": "failed" if self.state == "failed" else "running",
                "message": self.message if self.state == "failed" else None,
                "pid": self.pid,
                "host": self.host,
                "port": self.port,
                "command": self.command,
                "sha256": self.sha256,
                "started_at": self.started_at,
                "agent_pid": os.getpid(),
            },
        )

    # -- the worker for a new replica -----------------------------------------------------------

    def run_new(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        weights, adapters = self._fetch_all()
        self.agent.evict()
        self._check_adapters(weights, adapters)
        self._start_engine(weights, adapters)
        self._wait_until_ready(adopted=False)
        self._watch()

    def _fetch_all(self) -> tuple[Path, list[tuple[AdapterSpec, Path]]]:
        spec, cache = self.spec, self.agent.cache
        weights, sha256 = cache.fetch(
            spec.source,
            spec.sha256,
            label="weights",
            progress=self._on_progress,
            cancelled=self.stop_requested,
        )
        with self.lock:
            self.sha256 = sha256
        adapters = []
        for adapter in spec.adapters:
            path, _ = cache.fetch(
                adapter.source,
                adapter.sha256,
                label=f"adapter {adapter.name}",
                progress=self._on_progress,
                cancelled=self.stop_requested,
            )
            adapters.append((adapter, path))
        return weights, adapters

    def _check_adapters(self, weights: Path, adapters: list[tuple[AdapterSpec, Path]]) -> None:
        """Refuse adapters llama.cpp would crash on, before any engine loads them."""
        if not adapters:
            return
        self._set("fetching", "checking the adapters against the model")
        names = [self.spec.model] + [adapter.name for adapter, _ in adapters]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ReplicaFailed(
                f"the name {duplicates[0]} is used twice (model and adapter names must differ, "
                "since each is asked for as a model); no engine was started"
            )
        try:
            model = read_header_from_file(weights, require_tensors=True)
        except GGUFError as exc:
            raise ReplicaFailed(
                f"the weights from {self.spec.source} cannot be read as a GGUF model, so its "
                f"adapters cannot be checked: {exc} No engine was started."
            ) from None
        if model.architecture is None:
            raise ReplicaFailed(
                f"the weights from {self.spec.source} do not say their architecture "
                "(general.architecture is missing), so its adapters cannot be checked; "
                "no engine was started"
            )
        reasons = []
        for adapter, path in adapters:
            try:
                header = read_header_from_file(path, require_tensors=True)
            except GGUFError as exc:
                reasons.append(f"the adapter {adapter.name} ({adapter.source}): {exc}")
                continue
            problems = adapter_problems(header, model.architecture, model=model)
            if problems:
                reasons.append(
                    f"the adapter {adapter.name} ({adapter.source}) cannot be used with "
                    f"{self.spec.model}: " + "; ".join(problems)
                )
        if reasons:
            raise ReplicaFailed("; ".join(reasons) + ". No engine was started.")

    def _sizes(self, weights: Path) -> tuple[int, int]:
        """The context per request, and the MiB of the engine's prompt cache: one slot's KV
        cache, as the control plane's memory estimate counts it (its default, 8 GiB, would
        overrun any reservation)."""
        # If the header is unreadable the engine will say why in its own words, which is the
        # more useful message.
        try:
            header = read_header_from_file(weights, require_tensors=False)
        except GGUFError:
            header = None
        trained = header.context_length if header is not None else None
        if self.spec.context_length:
            context = self.spec.context_length
        else:
            # Not more than the model was trained for.
            context = min(DEFAULT_CONTEXT_LENGTH, trained) if trained else DEFAULT_CONTEXT_LENGTH
        try:
            assert header is not None
            one_slot = estimate_memory_bytes(
                header, file_size=0, context_length=context
            ).prompt_cache_bytes
        except (AssertionError, GGUFError):
            return context, 0
        return context, max(1, -(-one_slot // (1 << 20)))

    def _start_engine(self, weights: Path, adapters: list[tuple[AdapterSpec, Path]]) -> None:
        port = self.agent.allocate_port(self)
        if port is None:
            low, high = self.agent.config.port_range
            raise ReplicaFailed(
                f"no port in {low}-{high} is free on {self.agent.config.address} for the engine; "
                "widen --port-range or stop what uses those ports"
            )
        executable = self.agent.config.engine or engine.find_engine()
        if executable is None:
            raise ReplicaFailed(
                "llama-server is not installed on this node: run `make setup` (it builds it), "
                f"or give its path with --llama-server or {engine.ENGINE_ENV}"
            )
        context, prompt_cache_mib = self._sizes(weights)
        settings = engine.EngineSettings(
            model_path=str(weights),
            model_alias=self.spec.model,
            host=self.host,
            port=port,
            context_length=context,
            prompt_cache_mib=prompt_cache_mib,
            slots=self.spec.slots,
            threads=self.spec.threads,
            adapters=tuple(engine.AdapterEntry(a.name, str(path), a.scale) for a, path in adapters),
        )
        try:
            command = engine.engine_command(settings, executable)
        except engine.BadAdapterPath as exc:
            raise ReplicaFailed(f"{exc}; no engine was started") from None
        with self.lock:
            # Checked under the lock that stop() and the agent's exit take, so an engine is
            # never started after either has looked for one to stop (it would be an orphan).
            if self.stop_requested.is_set() or self.agent.exiting.is_set():
                raise Cancelled
            self.process = engine.start_engine(command, self.folder / "engine.log")
            self.pid = self.process.pid
            self.command = command
            self.started_at = _now_iso()
            self._persist_locked()
        self._set("starting", f"starting the engine (pid {self.pid}) on port {port}")

    # -- the worker for an adopted engine -------------------------------------------------------

    def run_adopted(self) -> None:
        self._wait_until_ready(adopted=True)
        self._watch()

    # -- readiness and watching -----------------------------------------------------------------

    def _exit_text(self) -> str | None:
        """How the engine ended, or None while it runs."""
        with self.lock:
            process, pid = self.process, self.pid
        if process is not None:
            code = process.poll()
            if code is None:
                return None
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.valid_signals() else "?"
                return f"the engine was killed by signal {-code} ({name})"
            return f"the engine exited with code {code}"
        if pid is not None and engine.process_alive(pid):
            return None
        return "the engine exited (its exit code is unknown: an earlier agent started it)"

    def _fail_exited(self, how: str) -> None:
        output = engine.last_output(self.folder / "engine.log")
        self._fail(f"{how}; its last output:\n{output}")

    def _wait_until_ready(self, *, adopted: bool) -> None:
        timeout = self.agent.config.ready_timeout
        deadline = time.monotonic() + timeout
        host = self.host
        assert self.port is not None
        while True:
            if self.stop_requested.is_set():
                raise Cancelled
            how = self._exit_text()
            if how is not None:
                self._fail_exited(how)
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._kill_engine()
                output = engine.last_output(self.folder / "engine.log")
                self._fail(
                    f"the engine did not become ready within {timeout:g} s; "
                    f"its last output:\n{output}"
                )
                return
            try:
                engine.check_ready(
                    host,
                    self.port,
                    self.spec.model,
                    self._adapter_entries(),
                    timeout=max(1.0, remaining),
                )
            except engine.NotReady:
                self.stop_requested.wait(POLL_SECONDS)
                continue
            break
        self._set("ready", self._ready_text(adopted))

    def _adapter_entries(self) -> tuple[engine.AdapterEntry, ...]:
        # In the order the engine was given them: a request names an adapter by its index.
        return tuple(engine.AdapterEntry(a.name, "", a.scale) for a in self.spec.adapters)

    def _ready_text(self, adopted: bool) -> str:
        text = f"ready on port {self.port}"
        if self.spec.slots > 1:
            text += f", {self.spec.slots} slots"
        if self.spec.adapters:
            names = ", ".join(f"{a.name} (scale {a.scale:g})" for a in self.spec.adapters)
            text += f", serving {self.spec.model} and its adapters {names}"
        if adopted:
            text += f" (engine pid {self.pid}, adopted from an earlier agent)"
        return text

    def _watch(self) -> None:
        """Until the replica is stopped: fail it when its engine exits or stops answering
        /health (hung, stopped, deadlocked), and read its metrics for the heartbeat."""
        if self.state != "ready":
            return
        misses: list[str] = []
        next_probe = next_metrics = time.monotonic()
        while not self.stop_requested.wait(WATCH_SECONDS):
            how = self._exit_text()
            if how is not None:
                self._fail_exited(how)
                return
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + HEALTH_INTERVAL_SECONDS
                assert self.port is not None
                problem = engine.health(self.host, self.port, timeout=HEALTH_TIMEOUT_SECONDS)
                misses = [*misses, problem] if problem is not None else []
                if len(misses) >= HEALTH_MISSES:
                    self._fail_hung(misses)
                    return
            if now >= next_metrics and not misses:
                next_metrics = now + METRICS_INTERVAL_SECONDS
                self._read_metrics()
                if engine.rotate_log(
                    self.folder / "engine.log", self.agent.config.engine_log_max_bytes
                ):
                    log.info(
                        "%s: rotated its engine log (engine.log.1 is the one before)", self.label
                    )

    def _fail_hung(self, misses: list[str]) -> None:
        """The engine runs but does not answer: kill it (a stopped process never handles a
        SIGTERM) so that its memory and port come back, and say why."""
        with self.lock:
            pid = self.pid
        self._kill_engine(grace=0)
        self._fail(
            f"the engine (pid {pid}) stopped answering /health: {len(misses)} probes in a row "
            f"failed ({misses[-1]}), so it is hung, stopped or deadlocked; it was killed"
        )

    def _read_metrics(self) -> None:
        assert self.port is not None
        numbers = engine.read_metrics(self.host, self.port, timeout=HEALTH_TIMEOUT_SECONDS)
        if numbers is None:
            return
        now = time.monotonic()
        with self.lock:
            before, self._metrics_read = self._metrics_read, (now, numbers)
        report = {**numbers, "slots": float(self.spec.slots)}
        if before is not None and "predicted_tokens" in numbers:
            seconds = now - before[0]
            made = numbers["predicted_tokens"] - before[1].get("predicted_tokens", 0)
            report["tokens_per_second"] = round(max(made, 0) / seconds, 2) if seconds > 0 else 0
        with self.lock:
            self.engine_metrics = report

    def _kill_engine(self, grace: float = engine.STOP_GRACE_SECONDS) -> None:
        with self.lock:
            pid, process = self.pid, self.process
        if pid is not None:
            engine.stop_process_group(pid, child=process, grace=grace)

    # -- stopping -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the engine (SIGTERM, then SIGKILL after 10 s) and remove the replica's folder;
        the blobs stay in the cache."""
        with self.lock:
            self.stop_requested.set()
            pid, process = self.pid, self.process
        if pid is not None:
            log.info("%s: stopping its engine (pid %s)", self.label, pid)
            engine.stop_process_group(pid, child=process)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)
        log.info("%s: stopped and removed", self.label)


# -- the agent ----------------------------------------------------------------------------------


@dataclass
class NodeConfig:
    server: str
    token: str
    memory_gb: float
    cores: int
    gpus: int = 0
    gpu_memory_gb: float = 0
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE
    cache: Path = field(default_factory=lambda: default_cache_dir())
    address: str = "127.0.0.1"
    heartbeat_interval: float = DEFAULT_HEARTBEAT_SECONDS
    ready_timeout: float = DEFAULT_READY_TIMEOUT_SECONDS
    stop_engines_on_exit: bool = False
    engine: str | None = None  # llama-server's path; None: engine.find_engine()
    cache_max_gb: float | None = None  # None: the blob cache is not bounded
    engine_log_max_bytes: int = DEFAULT_ENGINE_LOG_MAX_BYTES


def default_cache_dir() -> Path:
    # Absolute, so that an agent restarted from another directory still finds (and adopts)
    # the engines the earlier one left running.
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmgw" / "node"


class Agent:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.server = config.server.rstrip("/")
        self.replicas_dir = config.cache / "replicas"
        self.cache = BlobCache(config.cache, credentials=self._credentials_for)
        self.lock = threading.Lock()
        self.replicas: dict[str, Replica] = {}
        self.stopping: dict[str, Replica] = {}
        self.wake = threading.Event()
        self.shutdown = threading.Event()
        self.exiting = threading.Event()
        self.interval = config.heartbeat_interval
        self.started_at = _now_iso()
        self.kept: tuple[tuple[str, str | None], ...] = ()
        self._over_budget: str | None = None
        self.node_name: str | None = None
        self._last_problem: str | None = None
        self._connected = False
        self.exit_signal: str | None = None
        self._lock_file: TextIO | None = None
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {config.token}"
        self.session.headers["User-Agent"] = f"llmgw-node/{_agent_version()}"

    def _credentials_for(self, url: str) -> dict[str, str]:
        """Downloads from the control plane's own origin (its mirror) carry the node token;
        other hosts never see it."""
        source, server = urlsplit(url), urlsplit(self.server)
        if (source.scheme, source.netloc) == (server.scheme, server.netloc):
            return {"Authorization": f"Bearer {self.config.token}"}
        return {}

    # -- start ----------------------------------------------------------------------------------

    def lock_cache(self) -> None:
        self.config.cache.mkdir(parents=True, exist_ok=True)
        path = self.config.cache / "agent.lock"
        lock_file = open(path, "a+")  # noqa: SIM115 - held open for the agent's lifetime
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "?"
            lock_file.close()
            raise SystemExit(
                f"llmgw node: another agent (pid {holder}) already uses the cache {self.config.cache}; "
                "each agent needs its own --cache."
            ) from None
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self._lock_file = lock_file

    def adopt_leftovers(self) -> None:
        """Take over the engines an earlier agent left running; clean up after dead ones."""
        self.replicas_dir.mkdir(parents=True, exist_ok=True)
        for folder in sorted(self.replicas_dir.iterdir()):
            if folder.is_dir():
                self._adopt_one(folder)

    def _adopt_one(self, folder: Path) -> None:
        try:
            record = json.loads((folder / "state.json").read_text())
            spec = ReplicaSpec.from_json(record["spec"])
        except (OSError, ValueError, KeyError, TypeError, AnswerError):
            log.info("removing %s: it holds no engine (its replica never started one)", folder)
            shutil.rmtree(folder, ignore_errors=True)
            return
        replica = Replica(self, spec)
        replica.sha256 = record.get("sha256")
        replica.port = record.get("port")
        if record.get("state") == "failed":
            # A failed replica stays failed while it is wanted, across agent restarts too.
            replica.state = "failed"
            replica.message = record.get("message") or "failed"
            self.replicas[spec.id] = replica
            return
        pid, command = record.get("pid"), record.get("command")
        if (
            isinstance(pid, int)
            and isinstance(command, list)
            and _same_engine(engine.process_cmdline(pid), command)
            and isinstance(replica.port, int)
        ):
            replica.host = record.get("host") or replica.host
            replica.pid = pid
            replica.command = command
            replica.started_at = record.get("started_at")
            replica.state = "starting"
            replica.message = (
                f"adopted the engine (pid {pid}) an earlier agent left running on port "
                f"{replica.port}; checking that it answers"
            )
            log.info("%s: %s", replica.label, replica.message)
            self.replicas[spec.id] = replica
            replica.start(replica.run_adopted)
            return
        log.info("replica %s: its engine (pid %s) is gone; removing its folder", spec.id, pid)
        shutil.rmtree(folder, ignore_errors=True)

    # -- ports ----------------------------------------------------------------------------------

    def allocate_port(self, replica: Replica) -> int | None:
        """The first port in the range that no other replica of this agent holds and that is
        free to bind now; it is the replica's from then on."""
        low, high = self.config.port_range
        with self.lock:
            held = {
                other.port
                for other in [*self.replicas.values(), *self.stopping.values()]
                if other is not replica and other.port is not None
            }
            for port in range(low, high + 1):
                if port not in held and engine.port_is_free(self.config.address, port):
                    with replica.lock:
                        replica.port = port
                    return port
        return None

    # -- the heartbeat --------------------------------------------------------------------------

    def heartbeat_body(self) -> dict[str, Any]:
        with self.lock:
            replicas = list(self.replicas.values())
        return {
            "capacity": {
                "memory_gb": self.config.memory_gb,
                "cores": self.config.cores,
                "gpus": self.config.gpus,
                "gpu_memory_gb": self.config.gpu_memory_gb,
            },
            "address": self.config.address,
            "agent": {
                "version": _agent_version(),
                "pid": os.getpid(),
                "started_at": self.started_at,
            },
            "replicas": [replica.report() for replica in replicas],
        }

    def heartbeat(self) -> None:
        url = f"{self.server}/api/v1/node/heartbeat"
        try:
            response = self.session.post(url, json=self.heartbeat_body(), timeout=HEARTBEAT_TIMEOUT)
        except requests.ConnectionError:
            self._problem(
                f"cannot reach the control plane at {self.server}: nothing answered. "
                "Keeping the engines running and trying again."
            )
            return
        except requests.Timeout:
            self._problem(
                f"the control plane at {self.server} did not answer in time. "
                "Keeping the engines running and trying again."
            )
            return
        except requests.RequestException as exc:
            self._problem(f"the heartbeat to {self.server} failed: {exc}. Trying again.")
            return
        if response.status_code == 401:
            self._problem(
                f"the control plane at {self.server} does not know this node's token; was the "
                "node removed? Register it again and restart the agent with the new token. "
                "Keeping the engines running and trying again."
            )
            return
        if response.status_code != 200:
            self._problem(
                f"the control plane at {self.server} refused the heartbeat "
                f"(HTTP {response.status_code}): {_detail(response)}. Trying again."
            )
            return
        try:
            answer = parse_answer(response.json())
        except (ValueError, AnswerError) as exc:
            self._problem(
                f"the control plane at {self.server} answered something this agent does not "
                f"understand ({exc}); nothing changes until it answers properly."
            )
            return
        self._recovered(response)
        if answer.interval is not None and answer.interval != self.interval:
            log.info("heartbeating every %g s, as the control plane asks", answer.interval)
            self.interval = answer.interval
        self.kept = answer.keep
        self.reconcile(answer.replicas)
        self.evict()

    def _problem(self, text: str) -> None:
        # Said once, not every two seconds; said again when it changes.
        if text != self._last_problem:
            log.warning("%s", text)
            self._last_problem = text

    def _recovered(self, response: requests.Response) -> None:
        with contextlib.suppress(ValueError, AttributeError):
            self.node_name = response.json().get("node") or self.node_name
        if self._last_problem is not None or not self._connected:
            log.info(
                "connected to the control plane at %s as node %s",
                self.server,
                self.node_name or "?",
            )
        self._connected = True
        self._last_problem = None

    def reconcile(self, specs: list[ReplicaSpec]) -> None:
        """Start what is wanted and missing; stop what runs and is not wanted."""
        wanted = {spec.id: spec for spec in specs}
        with self.lock:
            unwanted = [r for rid, r in self.replicas.items() if rid not in wanted]
            for replica in unwanted:
                del self.replicas[replica.spec.id]
                self.stopping[replica.spec.id] = replica
            for spec in specs:
                # An id that is still being stopped is started afresh once it is gone.
                if spec.id in self.replicas or spec.id in self.stopping:
                    continue
                replica = Replica(self, spec)
                self.replicas[spec.id] = replica
                log.info("%s: wanted; fetching %s", replica.label, spec.source)
                replica.start(replica.run_new)
        for replica in unwanted:
            threading.Thread(
                target=self._stop_replica,
                args=(replica,),
                name=f"stop-{replica.spec.id}",
                daemon=True,
            ).start()

    def needed_blobs(self) -> set[str]:
        """The sha256 of every file a replica here uses or may use (running, starting,
        stopping), and of the previous revisions the control plane asks to keep."""
        with self.lock:
            replicas = [*self.replicas.values(), *self.stopping.values()]
        sources = list(self.kept)
        for replica in replicas:
            sources.append((replica.spec.source, replica.spec.sha256 or replica.sha256))
            sources += [(a.source, a.sha256) for a in replica.spec.adapters]
        return {sha for source, known in sources if (sha := self.cache.sha256_of(source, known))}

    def evict(self) -> None:
        """Keep the blob cache within --cache-max-gb: least recently used first, never a
        file a replica here needs or a previous revision the control plane asks to keep."""
        if self.config.cache_max_gb is None:
            return
        limit = int(self.config.cache_max_gb * 1e9)
        evicted, total = self.cache.evict(limit, self.needed_blobs())
        for sha in evicted:
            log.info("cache: evicted %s, the least recently used file no replica needs", sha)
        problem = None
        if total > limit:
            problem = (
                f"cache: the files replicas here need take {total / 1e9:.2f} GB, above "
                f"--cache-max-gb {self.config.cache_max_gb:g}; nothing more can be evicted"
            )
        if problem is not None and problem != self._over_budget:
            log.warning("%s", problem)
        self._over_budget = problem

    def _stop_replica(self, replica: Replica) -> None:
        try:
            replica.stop()
        finally:
            with self.lock:
                self.stopping.pop(replica.spec.id, None)

    # -- the loop -------------------------------------------------------------------------------

    def check_address(self) -> None:
        try:
            engine.port_is_free(self.config.address, 0)
        except OSError as exc:
            raise SystemExit(
                f"llmgw node: engines cannot listen on {self.config.address}: "
                f"{exc.strerror or exc}. --address must be an address of this machine that the "
                "gateway can reach."
            ) from None

    def run(self) -> int:
        self.check_address()
        self.lock_cache()
        self.cache.prepare()
        executable = self.config.engine or engine.find_engine()
        if executable is None:
            log.warning(
                "llama-server is not installed beside %s nor on PATH, so every engine will fail "
                "to start; `make setup` builds it, or give its path with --llama-server",
                sys.executable,
            )
        else:
            log.info("engines run %s", executable)
        log.info(
            "node agent %s (pid %s) heartbeating to %s; cache %s; engines on %s, ports %s-%s",
            _agent_version(),
            os.getpid(),
            self.server,
            self.config.cache,
            self.config.address,
            *self.config.port_range,
        )
        self.adopt_leftovers()
        while not self.shutdown.is_set():
            self.wake.clear()
            try:
                self.heartbeat()
            except Exception:
                # A bug in handling one answer must not take the engines' supervisor down.
                log.exception("the heartbeat failed unexpectedly; trying again")
            self.wake.wait(self.interval)
            # State changes wake the loop early; a short pause keeps a burst to one heartbeat.
            self.shutdown.wait(0.05)
        log.info("received %s; exiting", self.exit_signal or "a stop request")
        self.exit()
        return 0

    def request_shutdown(self, signum: int, _frame: Any) -> None:
        # Only set flags here: the loop logs and exits (logging from a handler can interleave).
        self.exit_signal = signal.Signals(signum).name
        self.shutdown.set()
        self.wake.set()

    def exit(self) -> None:
        with self.lock:
            replicas = [*self.replicas.values(), *self.stopping.values()]
        # Taking each replica's lock waits out an engine start in progress, after which no
        # worker starts another: whatever runs is recorded in a state.json, for adoption.
        self.exiting.set()
        for replica in replicas:
            with replica.lock:
                pass
        if not self.config.stop_engines_on_exit:
            running = [r for r in replicas if r.pid is not None]
            if running:
                log.info(
                    "leaving %d engine(s) running for the next agent to adopt "
                    "(--stop-engines-on-exit stops them instead)",
                    len(running),
                )
            return
        stoppers = [threading.Thread(target=replica.stop) for replica in replicas]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join()


def _same_engine(running: list[str] | None, recorded: list[str]) -> bool:
    """Whether a live process is the engine that was recorded: the same arguments, which name
    the replica's blob, port or config file. The interpreter's path is not compared, so that a
    reinstalled virtualenv does not turn running engines into orphans; a reused pid never
    matches."""
    return running is not None and len(running) > 1 and running[1:] == recorded[1:]


def _detail(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    text = response.text.strip().replace("\n", " ")
    return text[:200] if text else response.reason or "no detail"


# -- the command line ---------------------------------------------------------------------------


def _port_range(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)-(\d+)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range like 41000-41999")
    low, high = int(match.group(1)), int(match.group(2))
    if not 1 <= low <= high <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r}: ports go from 1 to 65535, the first no higher than the last"
        )
    return low, high


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def add_parser(subparsers: Any) -> None:
    node = subparsers.add_parser(
        "node",
        help="run the node agent: fetch models and run their engines on this machine",
        description=(
            "Heartbeats this machine's capacity to the control plane and runs the replicas it "
            "answers with. Engines outlive the agent: a restarted agent adopts them. Stop it "
            "with SIGTERM or Ctrl-C."
        ),
    )
    node.add_argument(
        "--server",
        default=os.environ.get("LLMGW_URL"),
        help="the control plane's URL (default: LLMGW_URL)",
    )
    node.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help=(
            "a file holding this node's token (given when the node was registered); without "
            "it the token is read from LLMGW_NODE_TOKEN. There is no --token: a command line "
            "is visible to every user of the machine in `ps`"
        ),
    )
    # Refused with a reason (rather than left unknown, which argparse would read as an
    # abbreviation of --token-file).
    node.add_argument("--token", help=argparse.SUPPRESS)
    node.add_argument(
        "--llama-server",
        metavar="PATH",
        default=None,
        help=(
            "the llama-server executable engines run (default: LLMGW_LLAMA_SERVER, else the one "
            "`make setup` builds beside this Python, else llama-server on PATH)"
        ),
    )
    node.add_argument(
        "--memory",
        type=_positive_float,
        required=True,
        metavar="GB",
        help="host RAM the control plane may fill with replicas on this machine",
    )
    node.add_argument(
        "--cores",
        type=int,
        required=True,
        metavar="N",
        help="CPU cores the control plane may hand out to replicas on this machine",
    )
    node.add_argument("--gpus", type=int, default=0, metavar="N", help="GPUs (default 0)")
    node.add_argument(
        "--gpu-memory",
        type=float,
        default=0,
        metavar="GB",
        help="memory of each GPU (default 0)",
    )
    node.add_argument(
        "--port-range",
        type=_port_range,
        default=DEFAULT_PORT_RANGE,
        metavar="A-B",
        help="ports the engines may listen on (default {}-{})".format(*DEFAULT_PORT_RANGE),
    )
    node.add_argument(
        "--cache",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "where weights and replica state are kept (default $XDG_CACHE_HOME/llmgw/node, "
            "else ~/.cache/llmgw/node); a restarted agent must use the same one to adopt "
            "its engines"
        ),
    )
    node.add_argument(
        "--cache-max-gb",
        type=_positive_float,
        default=None,
        metavar="GB",
        help=(
            "bound the weights kept in the cache: past it, the least recently used files that "
            "no replica here needs and that are not a previous revision (kept for a rollback) "
            "are deleted (default: unbounded)"
        ),
    )
    node.add_argument(
        "--engine-log-max-mb",
        type=_positive_float,
        default=DEFAULT_ENGINE_LOG_MAX_BYTES / 1e6,
        metavar="MB",
        help=(
            "past this size an engine's log is moved to engine.log.1 and started afresh "
            "(default %(default)g)"
        ),
    )
    node.add_argument(
        "--address",
        default="127.0.0.1",
        help=(
            "the address the gateway reaches this machine's engines at; engines listen on it "
            "(default 127.0.0.1, which only works when everything runs on one machine)"
        ),
    )
    node.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        default=DEFAULT_HEARTBEAT_SECONDS,
        metavar="S",
        help=(
            "seconds between heartbeats until the control plane's answer sets its own "
            "(default %(default)g)"
        ),
    )
    node.add_argument(
        "--ready-timeout",
        type=_positive_float,
        default=DEFAULT_READY_TIMEOUT_SECONDS,
        metavar="S",
        help=(
            "seconds an engine has to answer a completion after it starts before it is "
            "stopped and its replica failed (default %(default)g)"
        ),
    )
    node.add_argument(
        "--stop-engines-on-exit",
        action="store_true",
        help=(
            "stop the engines when the agent exits; by default they keep serving and the next "
            "agent adopts them"
        ),
    )


def _token(args: argparse.Namespace) -> str:
    if args.token is not None:
        raise SystemExit(
            "llmgw node: --token is not taken: a command line is visible to every user of the "
            "machine (ps). Put the token in LLMGW_NODE_TOKEN or in a file named by --token-file."
        )
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise SystemExit(
                f"llmgw node: cannot read the token file {args.token_file}: {exc.strerror or exc}."
            ) from None
        if not token:
            raise SystemExit(f"llmgw node: the token file {args.token_file} is empty.")
        return token
    token = os.environ.get("LLMGW_NODE_TOKEN", "").strip()
    if not token:
        raise SystemExit(
            "llmgw node: give this node's token in LLMGW_NODE_TOKEN or in a file named by "
            "--token-file; the control plane gives one when the node is registered."
        )
    return token


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    if not args.server:
        raise SystemExit("llmgw node: give the control plane's URL with --server (or LLMGW_URL).")
    token = _token(args)
    return NodeConfig(
        server=args.server,
        token=token,
        memory_gb=args.memory,
        cores=args.cores,
        gpus=args.gpus,
        gpu_memory_gb=args.gpu_memory,
        port_range=args.port_range,
        cache=(args.cache or default_cache_dir()).expanduser().absolute(),
        address=args.address,
        heartbeat_interval=args.heartbeat_interval,
        ready_timeout=args.ready_timeout,
        stop_engines_on_exit=args.stop_engines_on_exit,
        engine=args.llama_server,
        cache_max_gb=args.cache_max_gb,
        engine_log_max_bytes=int(args.engine_log_max_mb * 1e6),
    )


@contextlib.contextmanager
def _logging_to_stderr() -> Iterator[None]:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s llmgw node: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    with _logging_to_stderr():
        agent = Agent(config)
        signal.signal(signal.SIGTERM, agent.request_shutdown)
        signal.signal(signal.SIGINT, agent.request_shutdown)
        return agent.run()
