"""The engine contract (llmgw/engines): the registry, llama-server's features, and that its
backend starts the engine exactly as llmgw/engine.py did before the contract (golden command
lines taken from that module)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from llmgw import engine, gguf
from llmgw.engines import DEFAULT_ENGINE, UnknownEngine, engine_names, get_engine
from llmgw.engines.base import (
    AdapterEntry,
    BadSettings,
    Engine,
    EngineSettings,
    Features,
    parse_prometheus,
)
from llmgw.engines.llamacpp import BadAdapterPath, LlamaServer

BASE: dict[str, Any] = {
    "model_path": "/c/m.gguf",
    "model_alias": "chat",
    "host": "127.0.0.1",
    "port": 8081,
    "context_length": 2048,
}
COMMON = (
    "--model /c/m.gguf --alias chat --host 127.0.0.1 --port 8081 --ctx-size 2048 --parallel 1 "
    "--cache-ram 0 --no-cache-idle-slots --metrics"
)
POOLING = "--embeddings --pooling mean --no-webui"
CUDA_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

# (settings, argv after the executable, environment), as llmgw/engine.py made them before.
GOLDEN: dict[str, tuple[dict[str, Any], str, dict[str, str]]] = {
    "cpu": ({}, f"{COMMON} {POOLING}", {}),
    "cpu with threads, slots and a prompt cache": (
        {"slots": 4, "threads": 2, "prompt_cache_mib": 17},
        "--model /c/m.gguf --alias chat --host 127.0.0.1 --port 8081 --ctx-size 8192 "
        "--parallel 4 --cache-ram 17 --no-cache-idle-slots --metrics "
        f"{POOLING} --threads 2 --threads-batch 2",
        {},
    ),
    "cpu on a GPU build": ({"hide_gpus": True}, f"{COMMON} {POOLING} --device none", {}),
    "one GPU": (
        {"devices": (0,), "device_uuids": ("GPU-a",), "gpu_layers": "all"},
        f"{COMMON} {POOLING} --n-gpu-layers all --fit off",
        {**CUDA_ORDER, "CUDA_VISIBLE_DEVICES": "GPU-a"},
    ),
    "two GPUs with a tensor split": (
        {
            "devices": (1, 3),
            "device_uuids": ("GPU-b", ""),
            "gpu_layers": 20,
            "tensor_split": (3.0, 1.5),
        },
        f"{COMMON} {POOLING} --n-gpu-layers 20 --fit off --split-mode layer --tensor-split 3,1.5",
        {**CUDA_ORDER, "CUDA_VISIBLE_DEVICES": "1,3"},
    ),
    "two GPUs, even": (
        {"devices": (0, 1), "gpu_layers": "all"},
        f"{COMMON} {POOLING} --n-gpu-layers all --fit off --split-mode layer --tensor-split 1,1",
        {**CUDA_ORDER, "CUDA_VISIBLE_DEVICES": "0,1"},
    ),
    "adapters": (
        {
            "adapters": (
                AdapterEntry("sql", "/c/a/sql.gguf", 0.5),
                AdapterEntry("fr", "/c/a/fr.gguf"),
            )
        },
        f"{COMMON} {POOLING} --lora-scaled /c/a/sql.gguf:0 --lora-scaled /c/a/fr.gguf:0",
        {},
    ),
    "a vision projector": (
        {"mmproj_path": "/c/mmproj.gguf"},
        f"{COMMON} {POOLING} --mmproj /c/mmproj.gguf",
        {},
    ),
    "a reranker": ({"reranking": True}, f"{COMMON} --reranking --no-webui", {}),
    "an api key file": (
        {"api_key_file": "/c/r/engine.key"},
        f"{COMMON} {POOLING} --api-key-file /c/r/engine.key",
        {},
    ),
}


# -- the registry ---------------------------------------------------------------------------


def test_it_gives_llama_server_by_default() -> None:
    assert DEFAULT_ENGINE == "llama.cpp"
    assert engine_names() == ("llama.cpp", "vllm")
    assert isinstance(get_engine(), LlamaServer)
    assert get_engine() is get_engine("llama.cpp")  # one backend per process


def test_it_refuses_an_unknown_engine_naming_the_known_ones() -> None:
    with pytest.raises(UnknownEngine) as refused:
        get_engine("tgi")
    assert str(refused.value) == (
        "there is no engine called 'tgi': the engines are llama.cpp, vllm"
    )


# -- llama-server's facts -------------------------------------------------------------------


def test_llama_server_features() -> None:
    backend = get_engine("llama.cpp")
    assert backend.name == "llama.cpp"
    assert (backend.executable, backend.executable_env) == ("llama-server", "LLMGW_LLAMA_SERVER")
    assert (backend.weights_format, backend.weights_suffix) == ("gguf", ".gguf")
    assert backend.default_context_length == engine.DEFAULT_CONTEXT_LENGTH == 2048
    assert backend.metric_names == engine.METRIC_NAMES
    assert backend.features == Features(
        # llama-server answers every endpoint the gateway has (one table: gateway.endpoints).
        endpoints=None,
        per_request_lora=True,
        embeddings=True,
        rerank=True,
        one_pooling=True,
        images=True,
        tool_calls=True,
        gpus=True,
        split_layers=True,
        tensor_parallel=False,
    )


@pytest.mark.parametrize(
    ("need", "reranking", "served"),
    [
        ("embeddings", False, True),
        ("reranking", False, False),
        ("embeddings", True, False),  # one pooling or the other
        ("reranking", True, True),
        ("images", False, False),  # not a need the gateway's endpoints have
    ],
)
def test_llama_server_serves_embeddings_or_rerank_as_it_was_started(
    need: str, reranking: bool, served: bool
) -> None:
    # What gateway.routing.Entry.serves said before it asked the engine.
    before = need == ("reranking" if reranking else "embeddings")
    assert get_engine().serves(need, reranking=reranking) is served is before


# -- no behaviour change ----------------------------------------------------------------------


@pytest.mark.parametrize("case", list(GOLDEN))
def test_the_command_line_is_what_llmgw_engine_made_before(case: str) -> None:
    changes, argv, environment = GOLDEN[case]
    settings = EngineSettings(**{**BASE, **changes})
    expected = ["/bin/llama-server", *argv.split(" ")]
    assert get_engine().command(settings, "/bin/llama-server") == expected
    assert engine.engine_command(settings, "/bin/llama-server") == expected
    assert get_engine().environment(settings) == environment
    assert engine.engine_environment(settings) == environment


def test_an_adapter_path_it_cannot_take_is_refused_as_bad_settings() -> None:
    settings = EngineSettings(**BASE, adapters=(AdapterEntry("a", "/c:d/a.gguf"),))
    with pytest.raises(BadSettings, match="':' or ','") as refused:
        get_engine().command(settings, "llama-server")
    assert isinstance(refused.value, BadAdapterPath)
    assert engine.BadAdapterPath is BadAdapterPath


@pytest.mark.parametrize(
    ("declared", "trained", "context"),
    [(None, None, 2048), (None, 512, 512), (4096, 512, 4096), (None, 100_000, 2048)],
)
def test_the_serving_context_is_as_before(
    declared: int | None, trained: int | None, context: int
) -> None:
    assert get_engine().serving_context(declared, trained) == context
    assert engine.serving_context(declared, trained) == context


def test_each_request_carries_its_lora_scales() -> None:
    adapters = [{"name": "a", "scale": 0.5}, {"name": "b"}]
    expected = [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]
    assert get_engine().lora_request(adapters, "b") == expected
    assert engine.lora_request(adapters, "b") == expected
    assert get_engine().lora_request([], "x") is None


def test_its_memory_model_is_the_gguf_arithmetic() -> None:
    kwargs = {"weights_bytes": 1000, "kv_bytes_per_token": 8, "context_length": 100, "slots": 3}
    memory = get_engine().serving_memory(**kwargs)
    assert memory == gguf.serving_memory(**kwargs)
    # Three slots of KV cache and one more slot's worth for the prompt cache.
    assert (memory.kv_cache_bytes, memory.prompt_cache_bytes) == (2400, 800)


def test_its_metrics_keep_llama_cpp_names_under_ours() -> None:
    text = (
        "# HELP llamacpp:prompt_tokens_total x\n"
        "llamacpp:prompt_tokens_total 12\n"
        'llamacpp:requests_processing{slot="0"} 1\n'
        "llamacpp:something_else 3\n"
    )
    numbers = {"prompt_tokens": 12.0, "requests_processing": 1.0}
    assert get_engine().parse_metrics(text) == numbers == engine.parse_metrics(text)


def test_its_offload_problem_reads_the_log() -> None:
    backend = get_engine()
    assert backend.offload_problem("load_tensors: offloaded 5/5 layers to GPU", "all", [0]) is None
    problem = backend.offload_problem("nothing offloaded", "all", [0, 1])
    assert problem is not None and problem.startswith("asked for all layers on CUDA devices 0, 1")


def test_it_finds_its_program_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", "/opt/llama-server")
    assert get_engine().find("/x/llama-server") == "/x/llama-server"
    assert get_engine().find() == "/opt/llama-server" == engine.find_engine()
    monkeypatch.delenv("LLMGW_LLAMA_SERVER")
    program = tmp_path / "llama-server"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    found = get_engine().find()
    # Beside this Python when `make setup` linked it there, else on PATH.
    assert found is not None and found.endswith("/llama-server")
    assert found == engine.find_engine()


# -- the contract's defaults, for an engine that does less ------------------------------------


class Minimal(Engine):
    name = "minimal"
    executable = "minimal-server"
    executable_env = "LLMGW_MINIMAL"
    install_hint = "install it"
    weights_format = "safetensors"
    weights_suffix = ".safetensors"
    features = Features(
        endpoints=frozenset({"/v1/chat/completions"}),
        per_request_lora=False,
        embeddings=True,
        rerank=False,
        one_pooling=False,
        images=False,
        tool_calls=False,
        gpus=False,
        split_layers=False,
        tensor_parallel=False,
    )


def test_a_backend_that_does_less_keeps_the_defaults() -> None:
    backend = Minimal()
    assert backend.serves("embeddings", reranking=True)  # both poolings at once
    assert not backend.serves("reranking", reranking=True)
    assert backend.lora_request([{"name": "a"}], "a") is None
    assert backend.backends("/bin/x") == (["CPU"], None)
    assert backend.offload_problem("", "all", [0]) is None
    assert backend.environment(EngineSettings(**BASE)) == {}
    assert backend.adapter_problems("http://m", "http://a", session=None, timeout=1) == (
        "unknown",
        [],
    )
    assert backend.serving_context(None, None) == 2048
    with pytest.raises(NotImplementedError):
        backend.command(EngineSettings(**BASE), "x")
    assert parse_prometheus("a 1\n", {}) == {}


def test_llmgw_engine_is_the_same_code_under_its_old_names() -> None:
    from llmgw.engines import base, llamacpp, process

    for name in engine.__all__:
        found = [getattr(m, name) for m in (base, llamacpp, process) if hasattr(m, name)]
        assert found and getattr(engine, name) is found[0], name
