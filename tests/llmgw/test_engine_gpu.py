"""The engine on GPUs (llmgw/engine.py): the command line and environment a replica's devices
give it, the backends an engine binary reports (the real CPU build, a fake CUDA build), and
what its log says of the layers it offloaded."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from llmgw import engine

REPO = Path(__file__).resolve().parents[2]
UUID_A = "GPU-5a1f3c0e-8d2b-4f6a-9c3e-1b2d3e4f5a6b"
UUID_B = "GPU-0b9e8d7c-6b5a-4c3d-8e2f-1a0b9c8d7e6f"

CPU = engine.EngineSettings(
    model_path="/cache/blobs/abc",
    model_alias="tiny-chat",
    host="127.0.0.1",
    port=41000,
    context_length=256,
    prompt_cache_mib=8,
    slots=2,
    threads=2,
)
# The command line every replica had before GPUs, which a CPU replica keeps.
CPU_COMMAND = [
    "llama-server",
    "--model",
    "/cache/blobs/abc",
    "--alias",
    "tiny-chat",
    "--host",
    "127.0.0.1",
    "--port",
    "41000",
    "--ctx-size",
    "512",
    "--parallel",
    "2",
    "--cache-ram",
    "8",
    "--no-cache-idle-slots",
    "--metrics",
    "--embeddings",
    "--pooling",
    "mean",
    "--no-webui",
    "--threads",
    "2",
    "--threads-batch",
    "2",
]


def fake_cuda_engine(folder: Path) -> str:
    """An executable that runs tests/support/cuda_engine.py."""
    path = folder / "llama-server"
    path.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{REPO}/tests/support/cuda_engine.py" "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


# -- the command line and environment -----------------------------------------------------------


def test_a_cpu_replica_runs_as_before() -> None:
    assert engine.engine_command(CPU, "llama-server") == CPU_COMMAND
    assert engine.engine_environment(CPU) == {}


def test_a_cpu_replica_on_an_engine_with_a_gpu_backend_is_kept_off_the_gpus() -> None:
    settings = replace(CPU, hide_gpus=True)

    assert engine.engine_command(settings, "llama-server") == [*CPU_COMMAND, "--device", "none"]
    assert engine.engine_environment(settings) == {}


def test_one_device_all_layers() -> None:
    settings = replace(CPU, devices=(3,), device_uuids=(UUID_A,), gpu_layers="all")

    assert engine.engine_command(settings, "llama-server") == [
        *CPU_COMMAND,
        "--n-gpu-layers",
        "all",
        "--fit",
        "off",
    ]
    assert engine.engine_environment(settings) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": UUID_A,
    }


def test_two_devices_split_by_layer_in_the_given_proportions() -> None:
    settings = replace(
        CPU,
        devices=(1, 0),
        device_uuids=(UUID_B, UUID_A),
        gpu_layers=20,
        tensor_split=(3.0, 1.5),
    )

    assert engine.engine_command(settings, "llama-server")[len(CPU_COMMAND) :] == [
        "--n-gpu-layers",
        "20",
        "--fit",
        "off",
        "--split-mode",
        "layer",
        "--tensor-split",
        "3,1.5",
    ]
    # In the replica's order: CUDA0 is device 1, whose share is 3.
    assert engine.engine_environment(settings)["CUDA_VISIBLE_DEVICES"] == f"{UUID_B},{UUID_A}"


def test_devices_without_known_uuids_are_named_by_index_in_pci_bus_order() -> None:
    settings = replace(CPU, devices=(2, 5), device_uuids=(UUID_A, ""), gpu_layers="all")

    assert engine.engine_environment(settings) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "2,5",
    }
    # Without proportions the layers are split evenly.
    assert engine.engine_command(settings, "llama-server")[-2:] == ["--tensor-split", "1,1"]


def test_the_engine_gets_its_environment_added_to_the_agents(tmp_path: Path) -> None:
    script = tmp_path / "env.sh"
    script.write_text('#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES|$CUDA_DEVICE_ORDER|$HOME"\n')
    script.chmod(0o755)
    log = tmp_path / "engine.log"

    process = engine.start_engine(
        [str(script)], log, {"CUDA_VISIBLE_DEVICES": UUID_A, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    )
    process.wait(timeout=10)

    home = Path.home()
    assert log.read_text() == f"{UUID_A}|PCI_BUS_ID|{home}\n"


# -- the engine's backends ----------------------------------------------------------------------


def test_backends_from_list_devices_outputs() -> None:
    cpu_only = "Available devices:\n  (none)\n"
    cuda_without_driver = (
        "ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for "
        "CUDA runtime version\nAvailable devices:\n  (none)\n"
    )
    two_gpus = (
        "Available devices:\n"
        "  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80520 MiB free)\n"
        "  CUDA1: NVIDIA H100 80GB HBM3 (81079 MiB, 80520 MiB free)\n"
        "  Vulkan0: NVIDIA H100 80GB HBM3 (81079 MiB, 80520 MiB free)\n"
    )
    assert engine.parse_backends(cpu_only) == ["CPU"]
    assert engine.parse_backends(cuda_without_driver) == ["CPU", "CUDA"]
    assert engine.parse_backends(two_gpus) == ["CPU", "CUDA", "Vulkan"]
    assert engine.parse_backends("  MTL0: Apple M2 Max (49152 MiB, 49151 MiB free)\n") == [
        "CPU",
        "Metal",
    ]
    # Words that merely look like devices are not backends.
    assert engine.parse_backends("  Foo0: bar\nCUDA0 said nothing\n\x00\xff\n") == ["CPU"]


def test_a_fake_cuda_build_reports_cuda(tmp_path: Path) -> None:
    assert engine.engine_backends(fake_cuda_engine(tmp_path)) == (["CPU", "CUDA"], None)


@pytest.mark.skipif(engine.find_engine() is None, reason="llama-server is not built")
def test_the_cpu_build_reports_cpu_only() -> None:
    assert engine.engine_backends(engine.find_engine()) == (["CPU"], None)


def test_an_engine_that_hangs_or_fails_on_list_devices_is_cpu_with_the_reason(
    tmp_path: Path,
) -> None:
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\nsleep 60\n")
    hangs.chmod(0o755)
    fails = tmp_path / "fails"
    fails.write_text("#!/bin/sh\necho '  CUDA0: x (1 MiB, 1 MiB free)'\nexit 3\n")
    fails.chmod(0o755)

    started = time.monotonic()
    assert engine.engine_backends(str(hangs), timeout=0.5) == (
        ["CPU"],
        f"{hangs} --list-devices did not finish within 0.5 s",
    )
    assert time.monotonic() - started < 5
    assert engine.engine_backends(str(fails)) == (
        ["CPU"],
        f"{fails} --list-devices exited with code 3",
    )
    assert engine.engine_backends(str(tmp_path / "missing"))[1] == (
        f"{tmp_path / 'missing'} --list-devices cannot run: No such file or directory"
    )


# -- the offload check --------------------------------------------------------------------------

LOADED_ON_GPU = """\
load_tensors: loading model tensors, this can take a while... (mmap = true, direct_io = false)
load_tensors: offloading output layer to GPU
load_tensors: offloading 4 repeating layers to GPU
load_tensors: offloaded 5/5 layers to GPU
load_tensors:        CUDA0 model buffer size =     2.50 MiB
load_tensors:   CPU_Mapped model buffer size =     0.52 MiB
"""


def test_an_engine_that_offloaded_all_layers_passes() -> None:
    report = engine.offload_report(LOADED_ON_GPU)

    assert report == engine.OffloadReport(5, 5, (("CUDA0", 2.5), ("CPU_Mapped", 0.52)))
    assert engine.offload_problem(report, "all", [0]) is None
    assert engine.offload_problem(report, 3, [0]) is None


def test_an_engine_that_offloaded_nothing_fails_with_the_figures() -> None:
    report = engine.offload_report("load_tensors: offloaded 0/5 layers to GPU\n")

    assert engine.offload_problem(report, "all", [0]) == (
        "asked for all layers on CUDA device 0, the engine offloaded 0/5: is it built with "
        "CUDA? `llama-server --list-devices` shows what it can use"
    )


def test_an_engine_that_says_nothing_of_offloading_fails() -> None:
    # What the CPU build logs: no offload line, only a CPU buffer.
    report = engine.offload_report("load_tensors:   CPU_Mapped model buffer size = 3.02 MiB\n")

    assert engine.offload_problem(report, 10, [0, 1]) == (
        "asked for 10 layers on CUDA devices 0, 1, the engine's log does not say it offloaded "
        'any (no "offloaded N/M layers to GPU" line): is llama-server built with CUDA and are '
        "the devices visible to it (driver, CUDA_VISIBLE_DEVICES)? `llama-server "
        "--list-devices` shows what it can use"
    )


def test_the_log_is_read_from_where_this_engine_started_and_bounded(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(LOADED_ON_GPU)  # an earlier engine's output
    start = log.stat().st_size
    with open(log, "a") as out:
        out.write("load_tensors:   CPU_Mapped model buffer size = 3.02 MiB\n" + "x" * 3_000_000)

    text = engine.read_log_from(log, start)

    assert len(text) == engine.OFFLOAD_LOG_MAX_BYTES
    assert engine.offload_report(text).offloaded is None
