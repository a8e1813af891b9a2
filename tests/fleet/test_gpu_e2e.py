"""GPUs end to end, on a machine without one: the control plane, a worker with beat, and two node
agents as processes. One agent runs on a "GPU machine": a fake nvidia-smi first on its PATH
(two GPUs, the first mostly held by another program) and an engine that says it was built with
CUDA (tests/support/cuda_engine.py: it answers --list-devices with CUDA devices, records its
command line and CUDA environment, prints the offload line, then becomes the real CPU
llama-server). The other runs the real CPU engine.

Real: the heartbeats, the storage of the devices, the planner's choice of a device, the answer,
the agent's command line and environment, the engine serving, the gateway. Not real: the GPU."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support.http_files import serve_directory
from tests.support.system import System, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
]

REPO = Path(__file__).resolve().parents[2]
BUSY_UUID = "GPU-11111111-2222-4333-8444-555555555555"
FREE_UUID = "GPU-66666666-7777-4888-9999-aaaaaaaaaaaa"
# 80 GB each; the first has 76 GB in use by a program that is not llmgw's.
SMI_OUTPUT = (
    f"0, {BUSY_UUID}, NVIDIA H100 80GB HBM3, 81920, 77824, 95\n"
    f"1, {FREE_UUID}, NVIDIA H100 80GB HBM3, 81920, 0, 0\n"
)
GPU_PROFILE = {"name": "gpu", "memory_gb": 1, "cores": 1, "gpus": 1, "gpu_memory_gb": 8}


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("weights")
    write_tiny_model(folder / "tiny.gguf", seed=3)
    with serve_directory(folder) as (base_url, _stats):
        yield base_url


def gpu_machine(folder: Path) -> dict[str, str]:
    bin_dir = folder / "gpu-bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "smi-output").write_text(SMI_OUTPUT)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncat "{bin_dir}/smi-output"\n')
    smi.chmod(0o755)
    engine = bin_dir / "llama-server"
    engine.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{REPO}/tests/support/cuda_engine.py" "$@"\n'
    )
    engine.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "LLMGW_LLAMA_SERVER": str(engine),
        "LLMGW_REAL_LLAMA_SERVER": str(find_engine()),
        "LLMGW_FAKE_ENGINE_RECORD": str(folder / "engine-record.json"),
        "LLMGW_FAKE_OFFLOADED": "3/3",
    }


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, weights: str) -> Iterator[System]:
    folder = tmp_path_factory.mktemp("gpu-system")
    running = System(folder, allowed_hosts=[urlsplit(weights).netloc])
    with running.running():
        token = running.add_node("gpu-1", memory_gb=4, cores=2, start=False)
        running.start_agent("gpu-1", token, memory_gb=4, cores=2, env=gpu_machine(folder))
        running.add_node("cpu-1", memory_gb=4, cores=2)
        running.wait_for_ready_nodes()
        yield running


def nodes(system: System) -> dict[str, Any]:
    return {n["name"]: n for n in system.api("GET", "nodes")}


def test_the_gpu_node_reports_its_devices_and_cuda_engine(system: System) -> None:
    gpu, cpu = nodes(system)["gpu-1"], nodes(system)["cpu-1"]
    assert gpu["devices_source"] == "nvidia-smi"
    assert gpu["engine_backends"] == ["CPU", "CUDA"] and cpu["engine_backends"] == ["CPU"]
    busy, free = gpu["devices"]
    assert (busy["uuid"], busy["used_by_others_gb"], busy["free_gb"]) == (BUSY_UUID, 76, 4)
    assert (free["uuid"], free["free_gb"]) == (FREE_UUID, 80)
    assert gpu["capacity"]["gpus"] == 2 and gpu["capacity"]["gpu_memory_gb"] == 80
    assert cpu["devices"] == [] and cpu["capacity"]["gpus"] == 0


def test_a_gpu_model_runs_on_the_device_with_room_and_answers(system: System, weights: str) -> None:
    system.api(
        "POST",
        "models?source_check=false",
        json={
            "name": "vision",
            "source": f"{weights}/tiny.gguf",
            "context_length": 256,
            "min_replicas": 1,
            "profiles": [GPU_PROFILE],
        },
    )

    def ready() -> list[dict[str, Any]]:
        target = system.api("GET", "models/vision/target")
        return [r for r in target["replicas"] if r["state"] == "ready"]

    wait_for(lambda: ready(), timeout=120, what="the GPU replica ready")
    (replica,) = ready()
    # The first GPU has 4 GB free (another program holds 76): the 8 GB replica goes to the second.
    assert replica["node"] == "gpu-1" and replica["devices"] == [1]
    assert "layers on GPU" in replica["message"]
    record = json.loads(Path(system.folder, "engine-record.json").read_text())
    assert record["env"]["CUDA_VISIBLE_DEVICES"] == FREE_UUID
    assert record["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    argv = record["argv"]
    assert argv[argv.index("--n-gpu-layers") + 1] == "all"
    free = nodes(system)["gpu-1"]["devices"][1]
    assert free["reserved_gb"] >= 8 and free["free_gb"] <= 72
    key = system.api("POST", "keys", json={"name": "gpu-e2e"})["key"]
    client = openai.OpenAI(base_url=f"{system.url}/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(
        model="vision", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content is not None


def test_a_gpu_profile_is_refused_where_no_engine_has_a_gpu_backend(
    system: System, weights: str
) -> None:
    system.api("POST", "nodes/gpu-1/cordon")
    try:
        definition = {
            "name": "vision-2",
            "source": f"{weights}/tiny.gguf",
            "context_length": 256,
            "min_replicas": 1,
            "profiles": [GPU_PROFILE],
        }
        plan = system.api("POST", "plan", json=definition)
        assert plan["placements"] == []
        (unplaced,) = plan["unplaced"]
        assert "no node has a GPU engine" in unplaced["reason"]
        assert "cpu-1" in unplaced["reason"] and "LLMGW_ENGINE=cuda" in unplaced["reason"]
    finally:
        system.api("POST", "nodes/gpu-1/uncordon")
