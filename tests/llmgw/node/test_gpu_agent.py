"""The node agent on a machine with GPUs, end to end without one: the real agent as a
subprocess, a fake ``nvidia-smi`` on its PATH (NVML cannot load here), a fake CUDA build of
llama-server (tests/support/cuda_engine.py: it lists CUDA devices, records the command line and
environment it was started with, and serves through the real CPU engine), and the fake control
plane whose recorded heartbeats the tests read. The agent's heartbeat body is also checked
in-process with a fake NVML.

Every process started here (agents, and the engines they start) is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw import engine
from llmgw.node import gpus
from llmgw.node.agent import Agent
from llmgw.node.config import NodeConfig
from tests.llmgw.node import test_agent as agent_tests
from tests.llmgw.node.test_agent import Agents, FakeControlPlane, Mirror, replica_spec, settled
from tests.support.fake_nvml import FakeGpu, FakeNvml

REPO = Path(__file__).resolve().parents[3]
UUID_A = "GPU-5a1f3c0e-8d2b-4f6a-9c3e-1b2d3e4f5a6b"
UUID_B = "GPU-0b9e8d7c-6b5a-4c3d-8e2f-1a0b9c8d7e6f"
SMI_OUTPUT = (
    f"0, {UUID_A}, NVIDIA H100 80GB HBM3, 81559, 4000, 12\n"
    f"1, {UUID_B}, NVIDIA H100 80GB HBM3, 81559, 0, [N/A]\n"
)
# The fixtures of the agent's own tests: the fake control plane, the agents, the model mirror.
plane = agent_tests.plane
agents = agent_tests.agents
files = agent_tests.files
mirror = agent_tests.mirror
ENGINE = engine.find_engine()


def needs_engine(test: Any) -> Any:
    """Runs the real engine (behind the fake CUDA one)."""
    skip = pytest.mark.skipif(
        ENGINE is None, reason="llama-server is not built (make setup builds it)"
    )
    return pytest.mark.engine(skip(test))


def _nvml_works_here() -> bool:
    nvml = gpus.load_nvml()
    if nvml is None:
        return False
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return False
    return True


# On a machine with a working driver the agent reads NVML, not the fake nvidia-smi.
no_real_nvml = pytest.mark.skipif(_nvml_works_here(), reason="NVML works on this machine")


@pytest.fixture
def gpu_machine(tmp_path: Path) -> dict[str, str]:
    """The environment of an agent on a machine with two GPUs and a CUDA build of the engine:
    a fake nvidia-smi first on PATH; the fake engine's record file. The engine's path is
    LLMGW_LLAMA_SERVER."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "smi-output").write_text(SMI_OUTPUT)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncat "{bin_dir}/smi-output"\n')
    smi.chmod(0o755)
    cuda_engine = bin_dir / "llama-server"
    cuda_engine.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{REPO}/tests/support/cuda_engine.py" "$@"\n'
    )
    cuda_engine.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "LLMGW_LLAMA_SERVER": str(cuda_engine),
        "LLMGW_REAL_LLAMA_SERVER": ENGINE or "",
        "LLMGW_FAKE_ENGINE_RECORD": str(tmp_path / "engine-record.json"),
    }


def engine_record(gpu_machine: dict[str, str]) -> dict[str, Any]:
    record = json.loads(Path(gpu_machine["LLMGW_FAKE_ENGINE_RECORD"]).read_text())
    assert isinstance(record, dict)
    return record


def gpu_replica(mirror: Mirror, **fields: Any) -> dict[str, Any]:
    return replica_spec(
        mirror, **{"devices": [1], "device_uuids": [UUID_B], "gpu_layers": "all", **fields}
    )


# -- what the agent reports ---------------------------------------------------------------------


def test_the_heartbeat_body_carries_the_devices_nvml_finds_and_the_engines_backends(
    tmp_path: Path,
) -> None:
    agent = Agent(NodeConfig(server="http://127.0.0.1:1", token="t", memory_gb=8, cores=2))
    agent.gpus = gpus.GpuDetector(
        nvml=FakeNvml(
            [
                FakeGpu(UUID_A, "NVIDIA L4", 24 << 30, 3 << 30, 50),
                FakeGpu(UUID_B, "NVIDIA L4", 23 << 30, 0, 0),
            ]
        )
    )
    agent._engine_backends = ["CPU", "CUDA"]

    body = agent.heartbeat_body()

    assert body["capacity"] == {"memory_gb": 8, "cores": 2, "gpus": 2, "gpu_memory_gb": 23.0}
    assert body["devices_source"] == "nvml"
    assert [(d["index"], d["uuid"], d["memory_used_mb"]) for d in body["devices"]] == [
        (0, UUID_A, 3072),
        (1, UUID_B, 0),
    ]
    assert body["engine_backends"] == ["CPU", "CUDA"]


@no_real_nvml
def test_the_agent_sends_the_gpus_nvidia_smi_reports_and_its_engines_cuda_backend(
    plane: FakeControlPlane, agents: Agents, gpu_machine: dict[str, str]
) -> None:
    agents.start(env=gpu_machine)

    report = plane.wait_for(lambda body: body, what="a heartbeat")

    assert report["devices_source"] == "nvidia-smi"
    assert report["devices"] == [
        {
            "index": 0,
            "uuid": UUID_A,
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_mb": 81559,
            "memory_used_mb": 4000,
            "utilization_pct": 12,
        },
        {
            "index": 1,
            "uuid": UUID_B,
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_mb": 81559,
            "memory_used_mb": 0,
            "utilization_pct": None,
        },
    ]
    assert report["engine_backends"] == ["CPU", "CUDA"]
    assert report["capacity"]["gpus"] == 2
    assert report["capacity"]["gpu_memory_gb"] == round(81559 / 1024, 2)


def test_declared_gpus_are_sent_instead_of_the_detected_ones(
    plane: FakeControlPlane, agents: Agents, gpu_machine: dict[str, str]
) -> None:
    agents.start("--gpus", "1", "--gpu-memory", "16", env=gpu_machine)

    report = plane.wait_for(lambda body: body, what="a heartbeat")

    assert report["devices_source"] == "flags"
    assert report["devices"] == [
        {
            "index": 0,
            "uuid": "",
            "name": "declared",
            "memory_total_mb": 16384,
            "memory_used_mb": 0,
            "utilization_pct": None,
        }
    ]
    assert report["capacity"]["gpus"] == 1
    assert report["capacity"]["gpu_memory_gb"] == 16


# -- starting replicas on GPUs ------------------------------------------------------------------


@needs_engine
def test_a_gpu_replica_whose_engine_offloads_nothing_fails_with_the_reason(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror, gpu_machine: dict[str, str]
) -> None:
    # The fake CUDA engine serves on the CPU and logs no offload, as a CUDA build that cannot
    # reach its GPU does.
    spec = gpu_replica(mirror)
    agent = agents.start_wanting(spec, env=gpu_machine)

    failed = settled(plane, spec, "failed")

    assert failed["message"] == (
        "asked for all layers on CUDA device 1, the engine's log does not say it offloaded any "
        '(no "offloaded N/M layers to GPU" line): is llama-server built with CUDA and are the '
        "devices visible to it (driver, CUDA_VISIBLE_DEVICES)? `llama-server --list-devices` "
        "shows what it can use; the engine was stopped"
    )
    record = engine_record(gpu_machine)
    assert record["env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": UUID_B}
    assert record["argv"][-4:] == ["--n-gpu-layers", "all", "--fit", "off"]
    assert agent.state(spec["id"])["state"] == "failed"


@needs_engine
def test_a_gpu_replica_over_two_devices_whose_engine_offloads_is_ready(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror, gpu_machine: dict[str, str]
) -> None:
    spec = gpu_replica(mirror, devices=[0, 1], device_uuids=[UUID_A, UUID_B], tensor_split=[2, 1])
    agents.start_wanting(spec, env={**gpu_machine, "LLMGW_FAKE_OFFLOADED": "5/5"})

    ready = settled(plane, spec, "ready")

    assert ready["message"] == f"ready on port {ready['port']}, 5/5 layers on GPU (CUDA0 2.5 MiB)"
    record = engine_record(gpu_machine)
    assert record["env"] == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": f"{UUID_A},{UUID_B}",
    }
    assert record["argv"][-8:] == [
        "--n-gpu-layers",
        "all",
        "--fit",
        "off",
        "--split-mode",
        "layer",
        "--tensor-split",
        "2,1",
    ]


@needs_engine
def test_a_cpu_replica_on_a_cuda_engine_is_kept_off_the_gpus(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror, gpu_machine: dict[str, str]
) -> None:
    spec = replica_spec(mirror)
    agents.start_wanting(spec, env=gpu_machine)

    ready = settled(plane, spec, "ready")

    assert ready["message"] == f"ready on port {ready['port']}"
    record = engine_record(gpu_machine)
    assert record["argv"][-2:] == ["--device", "none"]
    assert record["env"] == {}


@needs_engine
def test_a_gpu_replica_on_a_cpu_only_engine_fails_before_any_engine_starts(
    plane: FakeControlPlane, agents: Agents, mirror: Mirror, gpu_machine: dict[str, str]
) -> None:
    spec = gpu_replica(mirror)
    agents.start_wanting(spec, env={**gpu_machine, "LLMGW_LLAMA_SERVER": ENGINE or ""})

    failed = settled(plane, spec, "failed")

    assert failed["message"] == (
        "it is placed on GPU device(s) 1, but this node's llama-server has no GPU backend "
        "(`llama-server --list-devices` shows none): build it with CUDA (LLMGW_ENGINE=cuda "
        "make setup) and restart the agent; no engine was started"
    )
    assert failed["port"] is None
