"""llama.cpp's ``llama-server`` as an engine: its command line, GPUs, readiness, metrics, LoRA.

The program is built by ``make setup`` (scripts/build-llama-server). The module-level functions
are the backend's implementation (and what ``llmgw.engine`` re-exports for older callers);
:class:`LlamaServer` is its face in the engine contract (llmgw.engines.base). No Django.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw import gguf

from .base import (
    AdapterEntry,
    BadSettings,
    Engine,
    EngineSettings,
    Features,
    WeightsFacts,
    WeightsUnreadable,
    parse_prometheus,
)
from .process import LOG_READ_MAX_BYTES, run_bounded

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


ENGINE_NAME = "llama-server"
ENGINE_ENV = "LLMGW_LLAMA_SERVER"
# Tokens per request when the catalog gives no context_length (and the model was trained for
# at least that many): enough for a chat, and the KV cache of each slot stays small.
DEFAULT_CONTEXT_LENGTH = 2048


def serving_context(declared: int | None, trained: int | None) -> int:
    """The context per request (per slot) the engine is started with: the model's declared
    context_length, else the default but not more than the model was trained for."""
    return LlamaServer().serving_context(declared, trained)


def find_engine(explicit: str | None = None) -> str | None:
    """Where llama-server is: ``explicit`` (--llama-server), else $LLMGW_LLAMA_SERVER, else
    beside this Python interpreter (where ``make setup`` links it), else on PATH."""
    return LlamaServer().find(explicit)


class BadAdapterPath(BadSettings):
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


# "llama_model_load_from_file_impl: ... load_tensors: offloaded 5/5 layers to GPU"
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")
OFFLOAD_LOG_MAX_BYTES = LOG_READ_MAX_BYTES


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
    one token (asked with `key`, the engine's): Engine.check_ready."""
    LlamaServer().check_ready(host, port, alias, adapters, timeout=timeout, key=key)


# What the control plane keeps of the engine's Prometheus numbers (llama.cpp's names).
METRIC_NAMES = {
    "llamacpp:prompt_tokens_total": "prompt_tokens",
    "llamacpp:prompt_tokens_cached_total": "prompt_tokens_cached",
    "llamacpp:tokens_predicted_total": "predicted_tokens",
    "llamacpp:requests_processing": "requests_processing",
    "llamacpp:requests_deferred": "requests_deferred",
}


def parse_metrics(text: str) -> dict[str, float]:
    """The counters and gauges of METRIC_NAMES found in a Prometheus text answer."""
    return parse_prometheus(text, METRIC_NAMES)


def read_metrics(
    host: str, port: int, *, timeout: float, key: str | None = None
) -> dict[str, float] | None:
    """The engine's /metrics (asked with `key`, the engine's), or None when it does not answer
    them."""
    return LlamaServer().read_metrics(host, port, timeout=timeout, key=key)


class LlamaServer(Engine):
    """llama-server in the engine contract."""

    name = "llama.cpp"
    executable = ENGINE_NAME
    executable_env = ENGINE_ENV
    install_hint = (
        f"run `make setup` (it builds it), or give its path with --llama-server or {ENGINE_ENV}"
    )
    weights_format = "gguf"
    weights_suffix = ".gguf"
    default_context_length = DEFAULT_CONTEXT_LENGTH
    metric_names = METRIC_NAMES
    features = Features(
        # Every endpoint the gateway has (embeddings or rerank as it was started, images with a
        # projector): the gateway's table is made for it, so a new entry there is served.
        endpoints=None,
        per_request_lora=True,  # the request's "lora" field (lora_request)
        embeddings=True,  # --embeddings --pooling mean
        rerank=True,  # --reranking
        one_pooling=True,  # one or the other
        images=True,  # with --mmproj
        tool_calls=True,
        gpus=True,  # built with CUDA (LLMGW_ENGINE=cuda make setup)
        split_layers=True,  # --split-mode layer --tensor-split
        tensor_parallel=False,
    )

    def command(self, settings: EngineSettings, executable: str) -> list[str]:
        return engine_command(settings, executable)

    def environment(self, settings: EngineSettings) -> dict[str, str]:
        return engine_environment(settings)

    def backends(self, executable: str | None) -> tuple[list[str], str | None]:
        return engine_backends(executable)

    def offload_problem(
        self, log_text: str, gpu_layers: int | str, devices: Sequence[int]
    ) -> str | None:
        return offload_problem(offload_report(log_text), gpu_layers, devices)

    def lora_request(self, adapters: Sequence[Any], name: str) -> list[dict[str, Any]] | None:
        return lora_request(adapters, name)

    def adapter_problems(
        self, model_source: str, adapter_source: str, *, session: Any, timeout: float
    ) -> tuple[str, list[str]]:
        """The adapter must be a GGUF LoRA adapter for the model's architecture, read from the
        two files' headers over HTTP Range requests: llama.cpp takes a wrong adapter without
        complaint at start and crashes on the first request."""
        try:
            model_header = gguf.read_header_from_url(
                model_source, session=session, timeout=timeout, require_tensors=True
            )
            adapter_header = gguf.read_header_from_url(
                adapter_source, session=session, timeout=timeout, require_tensors=True
            )
        except gguf.GGUFError as exc:
            raise WeightsUnreadable(str(exc)) from exc.__cause__
        architecture = model_header.architecture or "unknown"
        return architecture, gguf.adapter_problems(adapter_header, architecture, model=model_header)

    def read_facts(
        self, source: str, *, session: Any, timeout: float, loaded_with: int = 0
    ) -> WeightsFacts:
        """From the GGUF header, read over HTTP Range requests."""
        try:
            header = gguf.read_header_from_url(source, session=session, timeout=timeout)
            if header.file_size is None:
                raise gguf.GGUFError("the server did not say how large the file is")
            per_token = self.kv_bytes_per_token(header)
        except gguf.GGUFError as exc:
            raise WeightsUnreadable(str(exc)) from exc.__cause__
        return WeightsFacts(
            header.file_size + loaded_with, per_token, header.context_length, header.block_count
        )

    def local_facts(self, weights: Path) -> WeightsFacts | None:
        try:
            header = gguf.read_header_from_file(weights, require_tensors=False)
            per_token = self.kv_bytes_per_token(header)
        except gguf.GGUFError:
            return None
        size = weights.stat().st_size if weights.exists() else 0
        return WeightsFacts(size, per_token, header.context_length, header.block_count)

    def serving_sizes(self, weights: Path, declared_context: int | None) -> tuple[int, int]:
        """The prompt store is one slot's KV cache, as the estimate counts it (llama-server's
        default, 8 GiB, would overrun any reservation)."""
        try:
            header = gguf.read_header_from_file(weights, require_tensors=False)
        except gguf.GGUFError:
            return self.serving_context(declared_context, None), 0
        context = self.serving_context(declared_context, header.context_length)
        try:
            one_slot = gguf.estimate_memory_bytes(
                header, file_size=0, context_length=context
            ).prompt_cache_bytes
        except gguf.GGUFError:
            return context, 0
        return context, max(1, -(-one_slot // (1 << 20)))

    def kv_bytes_per_token(self, header: Any) -> int:
        """K and V of every layer for one position, f16 (llama.cpp's default cache type)."""
        return gguf.kv_bytes_per_token(header)

    def serving_memory(
        self, *, weights_bytes: int, kv_bytes_per_token: int, context_length: int, slots: int
    ) -> gguf.MemoryEstimate:
        """The weights, a KV cache of ``context_length`` tokens per slot (``--ctx-size`` is split
        between the slots) and one slot's worth more for the prompt cache (``--cache-ram``, as
        the node sizes it)."""
        return gguf.serving_memory(
            weights_bytes=weights_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            context_length=context_length,
            slots=slots,
        )
