"""One replica: its worker thread, its engine, and what the heartbeat reports of it.

A new replica's worker fetches, checks, starts and then watches its engine; an adopted
one (an engine an earlier agent left running) is checked and watched. A failure is the
replica's, with the reason: the agent and the other replicas go on.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from llmgw import engine
from llmgw.engines import DEFAULT_ENGINE, get_engine
from llmgw.engines.base import BadSettings, NotReady
from llmgw.gguf import (
    GGUFError,
    adapter_problems,
    read_header_from_file,
)

from .cache import POLL_SECONDS, BlobCache, Cancelled, FetchFailed, write_json, write_private
from .config import NodeConfig
from .spec import AdapterSpec, FileSpec, ReplicaSpec

log = logging.getLogger("llmgw.node")

# How long a restarted agent waits for an adopted engine to answer before its first heartbeat.
ADOPTION_CHECK_SECONDS = 2.0
# The engine's key, in its replica's folder (mode 0600), named by --api-key-file.
KEY_FILE = "engine.key"
WATCH_SECONDS = 0.5  # how often a worker looks at its engine once it is ready
# A ready engine is probed every second; three probes in a row without an answer within a
# second fail the replica: a hung engine is reported within about 6 s (and withdrawn from
# routing with that report), while a busy one still answers /health in about a millisecond.
HEALTH_INTERVAL_SECONDS = 1.0
HEALTH_TIMEOUT_SECONDS = 1.0
HEALTH_MISSES = 3
METRICS_INTERVAL_SECONDS = 5.0


class ReplicaFailed(Exception):
    """Raised inside a worker to fail its replica with this message."""


class Host(Protocol):
    """What a replica asks of the agent that runs it."""

    config: NodeConfig
    cache: BlobCache
    replicas_dir: Path
    wake: threading.Event  # set to heartbeat now: a state changed
    exiting: threading.Event  # set when the agent exits: start no engine any more

    @property
    def engine_backends(self) -> list[str]: ...

    def allocate_port(self, replica: Replica) -> int | None: ...

    def executable_of(self, name: str) -> str | None: ...

    def evict(self) -> None: ...


class Replica:
    """One wanted replica: its worker thread, its engine, and what the heartbeat reports."""

    def __init__(self, agent: Host, spec: ReplicaSpec) -> None:
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
        # The key its engine was started with, which every request but /health sends: the
        # control plane's (spec.engine_key) for an engine this agent starts, the one in the
        # folder's engine.key for an adopted one. None: an engine without a key.
        self.key = spec.engine_key
        self._metrics_read: tuple[float, dict[str, float]] | None = None
        self._log_start = 0  # where the output of the engine this agent started begins
        self._offload = ""  # what its log says of its layers on GPUs, for the ready message
        # The engine's backend (llmgw.engines): how to start, check and read it.
        self.backend = get_engine(spec.engine)

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
        write_json(
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
        projector = self._fetch_projector()
        files = self._fetch_files()
        self.agent.evict()
        self._check_adapters(weights, adapters)
        self._start_engine(weights, adapters, projector, files)
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
        for index, adapter in enumerate(spec.adapters):
            path, _ = cache.fetch(
                adapter.source,
                adapter.sha256,
                label=f"adapter {adapter.name}",
                progress=self._on_progress,
                cancelled=self.stop_requested,
            )
            if self.backend.adapter_folder:
                path = self._adapter_folder(index, adapter, path)
            adapters.append((adapter, path))
        return weights, adapters

    def beside_adapter(self, adapter: AdapterSpec) -> list[str]:
        """The URLs of the files beside an adapter's source that make its folder (none for an
        engine whose adapters are one file)."""
        base = adapter.source.split("?", 1)[0].rsplit("/", 1)[0]
        return [f"{base}/{name}" for name in self.backend.adapter_folder[1:]]

    def _adapter_folder(self, index: int, adapter: AdapterSpec, source_file: Path) -> Path:
        """An adapter that is a folder (the engine's adapter_folder): its source and the files
        beside it, fetched and linked under adapters/<its place>/ (a number: no name the
        control plane sends becomes a path)."""
        folder = self.folder / "adapters" / str(index)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        first, *rest = self.backend.adapter_folder
        (folder / first).symlink_to(source_file)
        for name, url in zip(rest, self.beside_adapter(adapter), strict=True):
            path, _ = self.agent.cache.fetch(
                url,
                None,
                label=f"adapter {adapter.name}: {name}",
                progress=self._on_progress,
                cancelled=self.stop_requested,
            )
            (folder / name).symlink_to(path)
        return folder

    def _fetch_projector(self) -> Path | None:
        """The vision projector, verified as the weights are; None for a text model."""
        if self.spec.mmproj is None:
            return None
        path, _ = self.agent.cache.fetch(
            self.spec.mmproj.source,
            self.spec.mmproj.sha256,
            label="vision projector",
            progress=self._on_progress,
            cancelled=self.stop_requested,
        )
        return path

    def _fetch_files(self) -> list[tuple[FileSpec, Path]]:
        """A snapshot's other files, verified as the weights are; none for a one-file model."""
        fetched = []
        for file in self.spec.files:
            path, _ = self.agent.cache.fetch(
                file.source,
                file.sha256,
                label=file.path,
                progress=self._on_progress,
                cancelled=self.stop_requested,
            )
            fetched.append((file, path))
        return fetched

    def _snapshot(self, weights: Path, files: list[tuple[FileSpec, Path]]) -> Path:
        """The folder an engine that loads a snapshot is given: the source (its entry, the
        config.json) and the other files under their paths in the repository, each a link to
        its verified blob. Made anew each start (a spec's files never change)."""
        folder = self.folder / "snapshot"
        shutil.rmtree(folder, ignore_errors=True)
        entries = [(self.backend.snapshot_entry, weights)] + [(f.path, p) for f, p in files]
        for relative, blob in entries:
            link = folder / relative
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(blob)
        return folder

    def _check_adapters(self, weights: Path, adapters: list[tuple[AdapterSpec, Path]]) -> None:
        """Refuse adapters llama.cpp would crash on, before any engine loads them (an engine
        whose adapters are folders checks them itself when it starts)."""
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
        if self.backend.adapter_folder:
            return
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

    def _start_engine(
        self,
        weights: Path,
        adapters: list[tuple[AdapterSpec, Path]],
        projector: Path | None = None,
        files: list[tuple[FileSpec, Path]] | None = None,
    ) -> None:
        gpu_less = self.agent.engine_backends == ["CPU"] and self.backend.name == DEFAULT_ENGINE
        if self.spec.on_gpus and gpu_less:
            raise ReplicaFailed(
                f"it is placed on GPU device(s) {', '.join(map(str, self.spec.devices))}, but "
                "this node's llama-server has no GPU backend (`llama-server --list-devices` "
                "shows none): build it with CUDA (LLMGW_ENGINE=cuda make setup) and restart "
                "the agent; no engine was started"
            )
        port = self.agent.allocate_port(self)
        if port is None:
            low, high = self.agent.config.port_range
            raise ReplicaFailed(
                f"no port in {low}-{high} is free on {self.agent.config.address} for the engine; "
                "widen --port-range or stop what uses those ports"
            )
        executable = self.agent.executable_of(self.backend.name)
        if executable is None:
            raise ReplicaFailed(
                f"{self.backend.executable} is not installed on this node: "
                f"{self.backend.install_hint}"
            )
        # The engine sizes its KV cache as the control plane's estimate counts it (fleet.footprint);
        # if the weights cannot be read the engine says why in its own words, which is the more
        # useful message.
        context, prompt_cache_mib = self.backend.serving_sizes(weights, self.spec.context_length)
        if self.backend.weights_layout == "snapshot":
            weights = self._snapshot(weights, files or [])
        key_file = None
        if self.spec.engine_key:
            key_file = self.folder / KEY_FILE
            write_private(key_file, self.spec.engine_key + "\n")
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
            mmproj_path=str(projector) if projector is not None else None,
            reranking=self.spec.reranking,
            api_key_file=str(key_file) if key_file else None,
            **self._gpu_settings(),
        )
        try:
            command = self.backend.command(settings, executable)
        except BadSettings as exc:
            raise ReplicaFailed(f"{exc}; no engine was started") from None
        log_path = self.folder / "engine.log"
        try:
            self._log_start = log_path.stat().st_size
        except OSError:
            self._log_start = 0
        with self.lock:
            # Checked under the lock that stop() and the agent's exit take, so an engine is
            # never started after either has looked for one to stop (it would be an orphan).
            if self.stop_requested.is_set() or self.agent.exiting.is_set():
                raise Cancelled
            self.process = engine.start_engine(
                command, log_path, self.backend.environment(settings)
            )
            self.pid = self.process.pid
            self.command = command
            self.started_at = now_iso()
            self._persist_locked()
        self._set("starting", f"starting the engine (pid {self.pid}) on port {port}")

    def _gpu_settings(self) -> dict[str, Any]:
        """The engine's GPU settings: the replica's devices and layers; for a CPU replica on an
        engine that has a GPU backend, none of its GPUs (its default would offload to any it
        sees, into memory nobody reserved)."""
        spec = self.spec
        if not spec.on_gpus:
            gpu_engine = any(backend != "CPU" for backend in self.agent.engine_backends)
            return {"hide_gpus": gpu_engine}
        return {
            "devices": spec.devices,
            "device_uuids": spec.device_uuids,
            "gpu_layers": spec.gpu_layers,
            "tensor_split": spec.tensor_split,
            "gpu_memory_share": spec.gpu_memory_share,
        }

    def _check_offload(self) -> None:
        """A GPU replica's engine must say in its log that it put the layers asked for on its
        GPUs; an engine without a usable GPU backend would otherwise serve from the CPU,
        slowly, on memory the control plane did not reserve for it."""
        text = engine.read_log_from(self.folder / "engine.log", self._log_start)
        report = engine.offload_report(text)
        problem = engine.offload_problem(report, self.spec.gpu_layers, self.spec.devices)
        if problem is not None:
            self._kill_engine()
            raise ReplicaFailed(f"{problem}; the engine was stopped")
        on_gpus = [f"{name} {mib:g} MiB" for name, mib in report.buffers if "CPU" not in name]
        self._offload = f"{report.offloaded}/{report.layers} layers on GPU" + (
            f" ({', '.join(on_gpus)})" if on_gpus else ""
        )

    # -- the worker for an adopted engine -------------------------------------------------------

    def ready_at_adoption(self) -> bool:
        """One short readiness check of an adopted engine, before the agent's first heartbeat.

        Why: reported "starting" until the worker's check passes, a healthy engine would leave
        routing at the restarted agent's first heartbeat, and a model whose only ready replica it
        was answered 503 for that moment. An engine too busy to answer within
        ADOPTION_CHECK_SECONDS is checked by the worker as before."""
        assert self.port is not None
        try:
            self.backend.check_ready(
                self.host,
                self.port,
                self.spec.model,
                self._adapter_entries(),
                timeout=ADOPTION_CHECK_SECONDS,
                key=self.key,
            )
        except NotReady:
            return False
        with self.lock:
            self.state, self.message = "ready", self._ready_text(adopted=True)
        return True

    def run_adopted(self) -> None:
        if self.state != "ready":
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
        timeout = max(self.agent.config.ready_timeout, self.backend.ready_seconds)
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
                self.backend.check_ready(
                    host,
                    self.port,
                    self.spec.model,
                    self._adapter_entries(),
                    timeout=max(1.0, remaining),
                    key=self.key,
                )
            except NotReady:
                self.stop_requested.wait(POLL_SECONDS)
                continue
            break
        if not adopted and self.spec.on_gpus and self.backend.name == DEFAULT_ENGINE:
            # Before it is reported ready, so that nothing is routed to an engine on the CPU.
            self._check_offload()
        self._set("ready", self._ready_text(adopted))

    def _adapter_entries(self) -> tuple[engine.AdapterEntry, ...]:
        # In the order the engine was given them: a request names an adapter by its index.
        return tuple(engine.AdapterEntry(a.name, "", a.scale) for a in self.spec.adapters)

    def _ready_text(self, adopted: bool) -> str:
        text = f"ready on port {self.port}"
        if self.spec.slots > 1:
            text += f", {self.spec.slots} slots"
        if self._offload:
            text += f", {self._offload}"
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
                problem = self.backend.health(self.host, self.port, timeout=HEALTH_TIMEOUT_SECONDS)
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
        numbers = self.backend.read_metrics(
            self.host, self.port, timeout=HEALTH_TIMEOUT_SECONDS, key=self.key
        )
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


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
