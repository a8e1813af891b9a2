"""The engine contract: what the node agent, placement and the gateway may ask of an engine.

As Django's database backends are a base class plus a features object, an engine is a subclass
of :class:`Engine` (its command line, health, readiness, metrics, LoRA handling, weights format
and memory model) whose :class:`Features` say what it can serve. Code outside ``llmgw/engines/``
asks these and names no engine. Backends are registered in ``llmgw.engines`` by name. No Django.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import requests

if TYPE_CHECKING:
    from llmgw.gguf import MemoryEstimate


@dataclass(frozen=True)
class Features:
    """What an engine serves, as plain facts for the gateway, placement and the catalog."""

    # The gateway's endpoint paths (gateway.endpoints.ENDPOINTS) the engine answers itself;
    # None: every one the gateway has (the default engine's, for which the table is made).
    endpoints: frozenset[str] | None
    # A request picks its adapter (and scale), so one engine serves the base model and all its
    # adapters; otherwise adapters are fixed when the engine starts.
    per_request_lora: bool
    embeddings: bool
    rerank: bool
    # Embeddings and rerank exclude each other: an engine is started for one or the other
    # (the catalog's reranking says which).
    one_pooling: bool
    # Images in chat requests, for an engine started with a vision projector.
    images: bool
    tool_calls: bool
    # It can put a model's layers on GPUs.
    gpus: bool
    # One model's layers split over several GPUs of a node, each GPU holding whole layers.
    split_layers: bool
    # One model's tensors split over several GPUs of a node, each GPU computing a share of every
    # layer.
    tensor_parallel: bool


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str
    scale: float = 1.0


@dataclass(frozen=True)
class EngineSettings:
    """What one engine process serves, and where: a replica's spec as the engine sees it."""

    model_path: str
    model_alias: str
    host: str
    port: int
    context_length: int  # per request (per slot)
    prompt_cache_mib: int = 0  # the RAM kept for earlier prompts' KV cache; 0 keeps none
    slots: int = 1
    threads: int | None = None
    adapters: tuple[AdapterEntry, ...] = field(default_factory=tuple)
    # The model's vision projector, of the weights' revision; None for a model without one,
    # which then refuses requests with images.
    mmproj_path: str | None = None
    # The engine ranks documents (/v1/rerank: a reranker's weights) instead of computing
    # embeddings (Features.one_pooling).
    reranking: bool = False
    # A file holding the key every request but /health must send: a file, so that no command
    # line shows it.
    api_key_file: str | None = None
    # GPUs. devices: the node's device indices (NVML's, the PCI bus order); device_uuids: theirs,
    # "" when unknown; gpu_layers: "all" or a number, None for a CPU replica; tensor_split: one
    # proportion per device when there are 2+.
    devices: tuple[int, ...] = ()
    device_uuids: tuple[str, ...] = ()
    gpu_layers: int | str | None = None
    tensor_split: tuple[float, ...] = ()
    # The share of each device's memory the replica may take (placement's reservation), for an
    # engine that is told it; None: the engine's own rule.
    gpu_memory_share: float | None = None
    # A CPU replica on an engine built with a GPU backend: keep it off every GPU.
    hide_gpus: bool = False


@dataclass(frozen=True)
class WeightsFacts:
    """What placement's memory estimate needs of a model's weights, read from their header (a
    GGUF file's) or their config (a snapshot's config.json)."""

    weights_bytes: int  # what the engine loads: the weights and the files it holds with them
    kv_bytes_per_token: int  # K and V of every layer for one position
    trained_context: int | None
    block_count: int | None = None  # the model's layers


class BadSettings(ValueError):
    """The engine cannot be started with these settings; the message says why and what to do."""


class WeightsUnreadable(Exception):
    """A weights file's header could not be read; the message says why, and ``__cause__`` is
    the refusal of its URL when that was the reason."""


class NotReady(Exception):
    """The engine does not (yet) serve; the message says what it answered."""


def key_headers(key: str | None) -> dict[str, str]:
    """The headers that open an engine started with `key` (none for an engine without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


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


_METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str, names: Mapping[str, str]) -> dict[str, float]:
    """The numbers of a Prometheus text answer whose names ``names`` maps to the control plane's
    (the last sample of each, labels ignored)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match and match.group(1) in names:
            with contextlib.suppress(ValueError):
                found[names[match.group(1)]] = float(match.group(2))
    return found


class Engine:
    """One engine's backend. A subclass sets the class attributes and implements
    :meth:`command`, :meth:`check_ready` and :meth:`kv_bytes_per_token`; the rest has defaults
    that an engine answering ``/health`` and Prometheus ``/metrics`` can keep."""

    # The name a model definition and the node's report use ("llama.cpp").
    name: ClassVar[str]
    # The program's file name, looked for beside Python and on PATH, and the environment
    # variable that names its path instead.
    executable: ClassVar[str]
    executable_env: ClassVar[str]
    # How an operator gets it, for the refusal when a node has none.
    install_hint: ClassVar[str]
    # The weights it reads: a format's name and the file names' ending.
    weights_format: ClassVar[str]
    weights_suffix: ClassVar[str]
    # "file": one weights file, the model's source; "snapshot": a repository's folder, whose
    # snapshot_entry file is the model's source and whose other files are the model's files.
    weights_layout: ClassVar[str] = "file"
    snapshot_entry: ClassVar[str] = ""
    # The repository's files a snapshot is made of by default (globs), for a snapshot engine.
    snapshot_patterns: ClassVar[tuple[str, ...]] = ()
    # An adapter of its is one file, its source (()), or a folder of these files, the first
    # one its source and the rest beside it (PEFT's adapter_config.json and weights).
    adapter_folder: ClassVar[tuple[str, ...]] = ()
    # The least time a node gives it to become ready (its --ready-timeout when longer).
    ready_seconds: ClassVar[float] = 0
    # The control plane's name for it in traces (OpenTelemetry's gen_ai.system).
    system_name: ClassVar[str] = ""
    # Tokens per request when the catalog gives none (and the model was trained for that many).
    default_context_length: ClassVar[int] = 2048
    # Its Prometheus names -> the control plane's (prompt_tokens, requests_processing...).
    metric_names: ClassVar[Mapping[str, str]] = {}
    features: ClassVar[Features]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    # -- installing and starting --------------------------------------------------------------

    def find(self, explicit: str | None = None) -> str | None:
        """Where the engine's program is: ``explicit``, else the environment variable, else
        beside this Python interpreter (where ``make setup`` links it), else on PATH."""
        for candidate in (explicit, os.environ.get(self.executable_env)):
            if candidate:
                return candidate
        beside = Path(sys.executable).parent / self.executable
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
        return shutil.which(self.executable)

    def command(self, settings: EngineSettings, executable: str) -> list[str]:
        """The engine's argv for ``settings``; raises BadSettings when it cannot take them."""
        raise NotImplementedError

    def environment(self, settings: EngineSettings) -> dict[str, str]:
        """What the engine's environment gains beyond the agent's (GPUs it may see...)."""
        return {}

    def backends(self, executable: str | None) -> tuple[list[str], str | None]:
        """(backends, problem): the compute backends the installed program has ("CPU",
        "CUDA"...), and why they could not be read."""
        return ["CPU"], None

    def offload_problem(
        self, log_text: str, gpu_layers: int | str, devices: Sequence[int]
    ) -> str | None:
        """Why an engine asked for ``gpu_layers`` on ``devices`` did not put them there, from
        its log since it started; None when it did or the engine cannot tell."""
        return None

    # -- serving -------------------------------------------------------------------------------

    def health(self, host: str, port: int, *, timeout: float) -> str | None:
        """Liveness: None when the engine answers it is up, else what happened instead."""
        return health(host, port, timeout=timeout)

    def check_ready(
        self,
        host: str,
        port: int,
        alias: str,
        adapters: Sequence[AdapterEntry],
        *,
        timeout: float,
        key: str | None = None,
    ) -> None:
        """Raise NotReady unless /health answers 200 and the model and every adapter compute
        one token (a completion asked with `key`, the engine's, and for an adapter what
        lora_request says a request for it carries)."""
        problem = health(host, port, timeout=min(timeout, 5))
        if problem is not None:
            raise NotReady(f"/health: {problem}")
        for name in [alias, *(adapter.name for adapter in adapters)]:
            body: dict[str, Any] = {"model": name, "prompt": "hi", "max_tokens": 1}
            lora = self.lora_request(adapters, name)
            if lora is not None:
                body["lora"] = lora
            try:
                answer = requests.post(
                    f"http://{host}:{port}/v1/completions",
                    json=body,
                    headers=key_headers(key),
                    timeout=timeout,
                )
            except requests.RequestException as exc:
                raise NotReady(f"a completion for {name}: {exc.__class__.__name__}") from None
            if answer.status_code != 200:
                raise NotReady(f"a completion for {name} answered {answer.status_code}")

    def parse_metrics(self, text: str) -> dict[str, float]:
        return parse_prometheus(text, self.metric_names)

    def read_metrics(
        self, host: str, port: int, *, timeout: float, key: str | None = None
    ) -> dict[str, float] | None:
        """The engine's /metrics in the control plane's names (asked with `key`, the
        engine's), or None when it does not answer them."""
        try:
            answer = requests.get(
                f"http://{host}:{port}/metrics", headers=key_headers(key), timeout=timeout
            )
        except requests.RequestException:
            return None
        if answer.status_code != 200:
            return None
        return self.parse_metrics(answer.text)

    def lora_request(self, adapters: Sequence[Any], name: str) -> list[dict[str, Any]] | None:
        """What a request for ``name`` (the model or one of ``adapters``) must carry to get that
        adapter, for an engine with Features.per_request_lora; None when nothing."""
        return None

    def serves(self, need: str, *, reranking: bool) -> bool:
        """Whether an engine started for a model that ranks documents (or not: the catalog's
        reranking) serves an endpoint that needs ``need`` ("embeddings", "reranking")."""
        features = self.features
        if need == "reranking":
            return features.rerank and reranking
        if need == "embeddings":
            return features.embeddings and not (reranking and features.one_pooling)
        return False

    def adapter_problems(
        self, model_source: str, adapter_source: str, *, session: Any, timeout: float
    ) -> tuple[str, list[str]]:
        """(the model's architecture, what makes the adapter unusable with the model), read
        from the two files at these URLs through ``session`` (a requests session); raises
        WeightsUnreadable. An engine that checks adapters itself at start finds nothing here."""
        return "unknown", []

    # -- placement -----------------------------------------------------------------------------

    def serving_context(self, declared: int | None, trained: int | None) -> int:
        """The context per request the engine is started with: the model's declared
        context_length, else the default but not more than the model was trained for."""
        if declared:
            return declared
        default = self.default_context_length
        return min(default, trained) if trained else default

    def read_facts(
        self, source: str, *, session: Any, timeout: float, loaded_with: int = 0
    ) -> WeightsFacts:
        """The facts of the weights at ``source`` (a URL, read through ``session``, a requests
        session that checks every hop), with ``loaded_with`` bytes of other files the engine
        loads beside them; raises WeightsUnreadable."""
        raise NotImplementedError

    def local_facts(self, weights: Path) -> WeightsFacts | None:
        """The same facts from the fetched weights on a node (the source's file there); None
        when they cannot be read (the engine will say why in its own words)."""
        return None

    def serving_sizes(self, weights: Path, declared_context: int | None) -> tuple[int, int]:
        """(the context per request, the MiB of the engine's store of earlier prompts) a node
        starts the engine with for the fetched weights at ``weights``: sized as the control
        plane's memory estimate counts them (fleet.footprint). No store by default."""
        facts = self.local_facts(weights)
        trained = facts.trained_context if facts is not None else None
        return self.serving_context(declared_context, trained), 0

    def kv_bytes_per_token(self, header: Any) -> int:
        """The KV cache bytes one position takes, from the weights' header as its format
        reads it."""
        raise NotImplementedError

    def serving_memory(
        self, *, weights_bytes: int, kv_bytes_per_token: int, context_length: int, slots: int
    ) -> MemoryEstimate:
        """What a replica holds in memory: its weights and the KV cache of ``slots`` requests of
        ``context_length`` tokens, as this engine allocates them."""
        raise NotImplementedError
