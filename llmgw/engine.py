"""The llama.cpp engine as the node agent runs it: command line, process, health, stopping.

The engine is llama.cpp's own ``llama-server``, built by ``make setup``
(scripts/build-llama-server). It runs in its own session (process group) so that it outlives
the agent: a restarted agent adopts it instead of reloading the model. This module must not
import Django.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

# What llama-server does, measured on the llama.cpp tree llama-cpp-python 0.3.36 vendors;
# each fact shapes the code below.
#
# - ``--parallel N`` serves N requests at once (continuous batching over N slots), and ``-c`` is
#   split between the slots: each slot gets ``-c / N`` tokens, so ``-c`` is context x slots.
# - ``/health`` answers 503 while the model loads and 200 once it is loaded, in about a
#   millisecond even while a long prompt is being processed. A stopped or deadlocked engine
#   answers nothing at all (every endpoint times out), so liveness is "``/health`` answers within
#   a short timeout", counted over a few probes. Readiness is ``/health`` 200 *and* a 1-token
#   completion for every name the engine serves, as before: it proves the model computes.
# - LoRA adapters are loaded at start (``--lora-scaled FILE:SCALE``; ``:`` and ``,`` are its
#   separators, so a path holding either cannot be given). A request carrying
#   ``"lora": [{"id": i, "scale": s}]`` runs with adapter ``i`` at scale ``s`` and every other
#   adapter at 0; a request without it runs with the scales given at start. Adapters are started
#   at scale 0, and every request carries the field (:func:`lora_request`): the adapter asked for
#   at its declared scale, the others at 0, so one engine serves the base model and all its
#   adapters, each request at its own. A changed set clears the slot's prompt cache, so a cached
#   prompt never leaks across adapters (a request *without* the field does not clear it).
# - A bad adapter (wrong architecture, a missing half) stops it at start with exit 1 and a clear
#   message; the agent still checks adapters first, to say which one and why.
# - ``/metrics`` (Prometheus, with ``--metrics``) gives tokens, busy slots and prompt-cache
#   counters (:func:`read_metrics`). ``/v1/embeddings`` needs ``--embeddings --pooling mean``;
#   completions and chat keep working with it.
# - ``--mmproj FILE`` (a vision projector GGUF of the model's repository) lets chat completions
#   carry images (``image_url`` parts, data URLs); without one such a request is refused. The
#   projector's output must be as wide as the model's embedding, or the engine exits at start.
# - Answers name the model by ``--alias`` (the catalog name), whatever the request asked for.

STOP_GRACE_SECONDS = 10.0
LAST_OUTPUT_LINES = 15
ENGINE_NAME = "llama-server"
ENGINE_ENV = "LLMGW_LLAMA_SERVER"
# Tokens per request when the catalog gives no context_length (and the model was trained for
# at least that many): enough for a chat, and the KV cache of each slot stays small.
DEFAULT_CONTEXT_LENGTH = 2048


def serving_context(declared: int | None, trained: int | None) -> int:
    """The context per request (per slot) the engine is started with: the model's declared
    context_length, else the default but not more than the model was trained for."""
    if declared:
        return declared
    return min(DEFAULT_CONTEXT_LENGTH, trained) if trained else DEFAULT_CONTEXT_LENGTH


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str
    scale: float = 1.0


@dataclass(frozen=True)
class EngineSettings:
    """What one engine process serves, and where."""

    model_path: str
    model_alias: str
    host: str
    port: int
    context_length: int  # per request (per slot)
    prompt_cache_mib: int = 0  # the RAM kept for earlier prompts' KV cache; 0 keeps none
    slots: int = 1
    threads: int | None = None
    adapters: tuple[AdapterEntry, ...] = field(default_factory=tuple)
    # The model's vision projector (llama-server's --mmproj), of the weights' revision; None
    # for a model without one, which then refuses requests with images.
    mmproj_path: str | None = None
    # The engine ranks documents (/v1/rerank, --reranking: a reranker's weights, the score read
    # from the last token) instead of computing embeddings (--embeddings --pooling mean): one
    # pooling or the other.
    reranking: bool = False
    # A file holding the key every request but /health must send (llama-server's
    # --api-key-file): a file, not --api-key, so that no command line shows it.
    api_key_file: str | None = None
    # GPUs (see "GPUs" below). devices: the node's device indices (NVML's, the PCI bus order);
    # device_uuids: theirs, "" when unknown; gpu_layers: "all" or a number, None for a CPU
    # replica; tensor_split: one proportion per device when there are 2+.
    devices: tuple[int, ...] = ()
    device_uuids: tuple[str, ...] = ()
    gpu_layers: int | str | None = None
    tensor_split: tuple[float, ...] = ()
    # A CPU replica on an engine built with a GPU backend: keep it off every GPU.
    hide_gpus: bool = False


def key_headers(key: str | None) -> dict[str, str]:
    """The headers that open an engine started with `key` (none for an engine without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def find_engine(explicit: str | None = None) -> str | None:
    """Where llama-server is: ``explicit`` (--llama-server), else $LLMGW_LLAMA_SERVER, else
    beside this Python interpreter (where ``make setup`` links it), else on PATH."""
    for candidate in (explicit, os.environ.get(ENGINE_ENV)):
        if candidate:
            return candidate
    beside = Path(sys.executable).parent / ENGINE_NAME
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(ENGINE_NAME)


class BadAdapterPath(ValueError):
    """llama-server cannot be given this adapter path on its command line."""


def engine_command(settings: EngineSettings, executable: str) -> list[str]:
    """The engine's argv; everything is on the command line, so ``ps`` shows what runs."""
    command = [
        executable,
        "--model",
        settings.model_path,
        "--alias",
        settings.model_alias,
        "--host",
        settings.host,
        "--port",
        str(settings.port),
        # Split between the slots: each request gets context_length tokens.
        "--ctx-size",
        str(settings.context_length * settings.slots),
        "--parallel",
        str(settings.slots),
        "--cache-ram",
        str(settings.prompt_cache_mib),
        # Otherwise every new request copies each idle slot's KV cache into the RAM cache (the
        # slots keep theirs anyway), and with a RAM cache of one slot's worth those copies evict
        # one another and the one that mattered: the prompt a slot gave up for another. Without
        # it, a slot's prompt is kept when another prompt takes the slot over, which is what
        # brings an earlier conversation back in milliseconds.
        "--no-cache-idle-slots",
        "--metrics",
        *(("--reranking",) if settings.reranking else ("--embeddings", "--pooling", "mean")),
        "--no-webui",
    ]
    if settings.api_key_file is not None:
        command += ["--api-key-file", settings.api_key_file]
    if settings.threads is not None:
        # Prompt processing uses its own thread count, which defaults to every core of the
        # machine; set both, so that replicas sharing a node stay within the cores they reserved.
        command += ["--threads", str(settings.threads), "--threads-batch", str(settings.threads)]
    for adapter in settings.adapters:
        if ":" in adapter.path or "," in adapter.path:
            raise BadAdapterPath(
                f"the adapter file {adapter.path} has ':' or ',' in its path, which llama-server "
                "cannot take (they separate its --lora-scaled values); use a --cache folder "
                "without them"
            )
        # Scale 0 at start: each request asks for its adapter (lora_request).
        command += ["--lora-scaled", f"{adapter.path}:0"]
    if settings.mmproj_path is not None:
        command += ["--mmproj", settings.mmproj_path]
    return command + _gpu_arguments(settings)


def lora_request(adapters: Sequence[Any], name: str) -> list[dict[str, Any]] | None:
    """The ``lora`` field of a request for ``name`` to an engine started with ``adapters``
    (in that order; entries with ``name`` and ``scale``, as objects or dicts): every adapter at
    0 but ``name``'s, at its scale (all at 0 for the base model). None when the engine has no
    adapters.

    The base model's requests must carry the field too: a request without it takes the start
    scales without clearing the slot's prompt cache, so a prompt cached under an adapter would
    be reused for the base model (measured: garbled output). With the field, a change of
    adapters clears that slot's cache."""
    if not adapters:
        return None
    lora = []
    for index, adapter in enumerate(adapters):
        if isinstance(adapter, dict):
            adapter_name, scale = adapter["name"], adapter.get("scale", 1.0)
        else:
            adapter_name, scale = adapter.name, adapter.scale
        chosen = adapter_name == name
        lora.append(
            {"id": index, "scale": float(1.0 if scale is None else scale) if chosen else 0.0}
        )
    return lora


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


# -- GPUs ---------------------------------------------------------------------------------------
#
# What llama-server (the llama.cpp tree of llama-cpp-python 0.3.36) does with GPUs, read from its
# source and --help:
# - --n-gpu-layers takes a number, "auto" or "all"; its default is "auto", so an engine built
#   with CUDA puts a CPU replica's layers on whatever GPU it sees unless told otherwise.
# - --device none keeps the model off every GPU device of every backend; a CPU-only build
#   accepts it (it names no device to look up).
# - --fit (default on) changes arguments not given to fit device memory; the control plane
#   sized the replica, so a GPU replica runs with --fit off: it fails loudly instead of quietly
#   holding other memory than it reserved.
# - Loading a model with a GPU backend logs "load_tensors: offloaded N/M layers to GPU" and one
#   "<buffer> model buffer size = X MiB" line per buffer (CUDA0, CPU_Mapped...); without a
#   usable GPU neither the offload line nor a GPU buffer appears. /props says nothing of devices,
#   so the log is what proves the offload (offload_report).
# - --list-devices prints "Available devices:" and one "  CUDA0: NAME (T MiB, F MiB free)" line
#   per non-CPU device, or "  (none)"; a CUDA build without a usable driver also prints
#   "ggml_cuda_init: failed to initialize CUDA: ..." (engine_backends).


def _gpu_arguments(settings: EngineSettings) -> list[str]:
    if settings.gpu_layers is None:
        # A CPU replica: its command line is what it was before GPUs, unless the engine could
        # reach a GPU, which it then must not (nothing reserved any GPU memory for it).
        return ["--device", "none"] if settings.hide_gpus else []
    arguments = ["--n-gpu-layers", str(settings.gpu_layers), "--fit", "off"]
    if len(settings.devices) > 1:
        split = settings.tensor_split or tuple(1.0 for _ in settings.devices)
        arguments += ["--split-mode", "layer", "--tensor-split", ",".join(f"{x:g}" for x in split)]
    return arguments


def engine_environment(settings: EngineSettings) -> dict[str, str]:
    """What the engine's environment gains: for a GPU replica, CUDA_VISIBLE_DEVICES naming its
    devices (their UUIDs, which cannot be misread, or their indices when a UUID is unknown) in
    PCI bus order, the order NVML and nvidia-smi number them in, so that the engine sees exactly
    its devices, as CUDA0, CUDA1... Nothing for a CPU replica."""
    if settings.gpu_layers is None:
        return {}
    if settings.device_uuids and all(settings.device_uuids):
        visible = ",".join(settings.device_uuids)
    else:
        visible = ",".join(str(index) for index in settings.devices)
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": visible}


LIST_DEVICES_TIMEOUT_SECONDS = 20.0
LIST_DEVICES_MAX_BYTES = 64 * 1024
MAX_BACKENDS = 16
# Device names as ggml's backends give them ("CUDA0", "Vulkan1", "ROCm0", "MTL0"...).
_DEVICE_LINE = re.compile(r"^\s+([A-Za-z][A-Za-z_]*?)\d+:\s")
_BACKEND_NAMES = {
    "CUDA": "CUDA",
    "ROCm": "ROCm",
    "HIP": "ROCm",
    "Vulkan": "Vulkan",
    "MTL": "Metal",
    "Metal": "Metal",
    "SYCL": "SYCL",
    "CANN": "CANN",
    "OpenCL": "OpenCL",
    "RPC": "RPC",
}
# What a build prints when it has a backend whose devices cannot be used here.
_INIT_LINES = {
    "ggml_cuda_init": "CUDA",
    "ggml_vulkan": "Vulkan",
    "ggml_metal_init": "Metal",
    "ggml_sycl_init": "SYCL",
}


def parse_backends(output: str) -> list[str]:
    """The backends ``llama-server --list-devices`` output shows: "CPU" always, then each GPU
    backend whose devices it lists or whose initialisation it prints (a CUDA build on a machine
    without a usable driver still has CUDA)."""
    backends = ["CPU"]
    for line in output.splitlines():
        match = _DEVICE_LINE.match(line)
        found = _BACKEND_NAMES.get(match.group(1)) if match else None
        if found is None:
            found = next((name for mark, name in _INIT_LINES.items() if mark in line), None)
        if found is not None and found not in backends and len(backends) < MAX_BACKENDS:
            backends.append(found)
    return backends


def engine_backends(
    executable: str | None, *, timeout: float = LIST_DEVICES_TIMEOUT_SECONDS
) -> tuple[list[str], str | None]:
    """(backends, problem): the engine binary's backends from its --list-devices, and why they
    could not be read (then ["CPU"], which every build has). Bounded: ``timeout`` seconds and
    LIST_DEVICES_MAX_BYTES of output."""
    if executable is None:
        return ["CPU"], "no llama-server to ask"
    command = f"{executable} --list-devices"
    try:
        code, output = run_bounded(
            [executable, "--list-devices"], timeout=timeout, max_bytes=LIST_DEVICES_MAX_BYTES
        )
    except subprocess.TimeoutExpired:
        return ["CPU"], f"{command} did not finish within {timeout:g} s"
    except OSError as exc:
        return ["CPU"], f"{command} cannot run: {exc.strerror or exc}"
    if code != 0:
        return ["CPU"], f"{command} exited with code {code}"
    return parse_backends(output.decode(errors="replace")), None


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


# "llama_model_load_from_file_impl: ... load_tensors: offloaded 5/5 layers to GPU"
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")
OFFLOAD_LOG_MAX_BYTES = 1024 * 1024


@dataclass(frozen=True)
class OffloadReport:
    """What an engine's log says of where its layers went."""

    offloaded: int | None  # None: the log has no offload line (no usable GPU backend)
    layers: int | None
    buffers: tuple[tuple[str, float], ...]  # (buffer, MiB) of the model's weights


def offload_report(text: str) -> OffloadReport:
    offloaded = layers = None
    for match in _OFFLOADED.finditer(text):  # the last load counts
        offloaded, layers = int(match.group(1)), int(match.group(2))
    buffers = tuple((m.group(1), float(m.group(2))) for m in _BUFFER.finditer(text))
    return OffloadReport(offloaded, layers, buffers)


def read_log_from(log_path: Path, offset: int, max_bytes: int = OFFLOAD_LOG_MAX_BYTES) -> str:
    """At most ``max_bytes`` of a log from ``offset`` (where this engine's output starts)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            return log.read(max_bytes).decode(errors="replace")
    except OSError:
        return ""


def offload_problem(
    report: OffloadReport, gpu_layers: int | str, devices: Sequence[int]
) -> str | None:
    """Why an engine asked for ``gpu_layers`` on ``devices`` did not put them there, or None
    when its log says it did."""
    asked = "all layers" if gpu_layers == "all" else f"{gpu_layers} layers"
    where = f"CUDA device{'s' if len(devices) > 1 else ''} {', '.join(map(str, devices))}"
    if report.offloaded is None or report.layers is None:
        return (
            f"asked for {asked} on {where}, the engine's log does not say it offloaded any "
            '(no "offloaded N/M layers to GPU" line): is llama-server built with CUDA and are '
            "the devices visible to it (driver, CUDA_VISIBLE_DEVICES)? `llama-server "
            "--list-devices` shows what it can use"
        )
    wanted = report.layers if gpu_layers == "all" else min(int(gpu_layers), report.layers)
    if report.offloaded < wanted:
        return (
            f"asked for {asked} on {where}, the engine offloaded {report.offloaded}/"
            f"{report.layers}: is it built with CUDA? `llama-server --list-devices` shows what "
            "it can use"
        )
    return None


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


# -- ports and readiness ---------------------------------------------------------------------


def port_is_free(host: str, port: int) -> bool:
    """Whether the engine could bind ``host:port`` now (llama-server sets SO_REUSEADDR, so a
    port whose last connection is in TIME_WAIT counts as free, as it does for the engine)."""
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


def health(host: str, port: int, *, timeout: float) -> str | None:
    """None when /health answers 200 within ``timeout``; otherwise what happened instead."""
    try:
        answer = requests.get(f"http://{host}:{port}/health", timeout=timeout)
    except requests.Timeout:
        return f"no answer within {timeout:g} s"
    except requests.RequestException as exc:
        return exc.__class__.__name__
    if answer.status_code != 200:
        return f"HTTP {answer.status_code}"
    return None


def check_ready(
    host: str,
    port: int,
    alias: str,
    adapters: Sequence[AdapterEntry],
    *,
    timeout: float,
    key: str | None = None,
) -> None:
    """Raise NotReady unless /health answers 200 and the base model and every adapter compute
    one token (asked with `key`, the engine's)."""
    problem = health(host, port, timeout=min(timeout, 5))
    if problem is not None:
        raise NotReady(f"/health: {problem}")
    base = f"http://{host}:{port}"
    for name in [alias, *(adapter.name for adapter in adapters)]:
        body: dict[str, Any] = {"model": name, "prompt": "hi", "max_tokens": 1}
        lora = lora_request(adapters, name)
        if lora is not None:
            body["lora"] = lora
        try:
            answer = requests.post(
                f"{base}/v1/completions", json=body, headers=key_headers(key), timeout=timeout
            )
        except requests.RequestException as exc:
            raise NotReady(f"a completion for {name}: {exc.__class__.__name__}") from None
        if answer.status_code != 200:
            raise NotReady(f"a completion for {name} answered {answer.status_code}")


# What the control plane keeps of the engine's Prometheus numbers (llama.cpp's names).
METRIC_NAMES = {
    "llamacpp:prompt_tokens_total": "prompt_tokens",
    "llamacpp:prompt_tokens_cached_total": "prompt_tokens_cached",
    "llamacpp:tokens_predicted_total": "predicted_tokens",
    "llamacpp:requests_processing": "requests_processing",
    "llamacpp:requests_deferred": "requests_deferred",
}
_METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """The counters and gauges of METRIC_NAMES found in a Prometheus text answer."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match and match.group(1) in METRIC_NAMES:
            with contextlib.suppress(ValueError):
                found[METRIC_NAMES[match.group(1)]] = float(match.group(2))
    return found


def read_metrics(
    host: str, port: int, *, timeout: float, key: str | None = None
) -> dict[str, float] | None:
    """The engine's /metrics (asked with `key`, the engine's), or None when it does not answer
    them."""
    try:
        answer = requests.get(
            f"http://{host}:{port}/metrics", headers=key_headers(key), timeout=timeout
        )
    except requests.RequestException:
        return None
    if answer.status_code != 200:
        return None
    return parse_metrics(answer.text)


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
