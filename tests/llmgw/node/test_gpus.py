"""GPU detection (llmgw/node/gpus.py) at its boundary: NVML's answers given through a fake
module, nvidia-smi's output through fake executables on disk (real processes, so timeouts and
output bounds are real), and the --gpus/--gpu-memory declaration."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from llmgw.cli import build_parser
from llmgw.node import gpus
from llmgw.node.cli import config_from_args
from llmgw.node.config import NodeConfig
from llmgw.node.gpus import GpuDetector, capacity, declared_devices, parse_nvidia_smi
from tests.support.fake_nvml import FakeGpu, FakeNvml

GIB = 1 << 30
MIB = 1 << 20
H100 = "GPU-5a1f3c0e-8d2b-4f6a-9c3e-1b2d3e4f5a6b"
L4 = "GPU-0b9e8d7c-6b5a-4c3d-8e2f-1a0b9c8d7e6f"


def nvml_two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(H100, "NVIDIA H100 80GB HBM3", 80 * GIB, 1234 * MIB + 5, 37),
            FakeGpu(L4, "NVIDIA L4", 24 * GIB, 0, None),
        ]
    )


def fake_program(folder: Path, name: str, body: str) -> str:
    """An executable shell script; its path."""
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def smi(folder: Path, output: str) -> str:
    (folder / "smi-output").write_text(output)
    return fake_program(folder, "nvidia-smi", f'cat "{folder}/smi-output"\n')


GOOD_SMI = (
    f"0, {H100}, NVIDIA H100 80GB HBM3, 81559, 1234, 37\n1, {L4}, NVIDIA L4, 23034, 0, [N/A]\n"
)


# -- NVML ---------------------------------------------------------------------------------------


def test_it_reads_each_device_through_nvml() -> None:
    detector = GpuDetector(nvml=nvml_two_gpus())

    devices, source = detector.devices()

    assert source == "nvml"
    assert devices == [
        {
            "index": 0,
            "uuid": H100,
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_mb": 81920,
            "memory_used_mb": 1234,
            "utilization_pct": 37,
        },
        {
            "index": 1,
            "uuid": L4,
            "name": "NVIDIA L4",
            "memory_total_mb": 24576,
            "memory_used_mb": 0,
            # This device does not support the query: unknown, not 0.
            "utilization_pct": None,
        },
    ]
    assert capacity(devices) == (2, 24.0)  # the smallest device's memory


def test_it_initialises_nvml_once_and_reads_it_at_most_every_refresh() -> None:
    nvml = nvml_two_gpus()
    now = [100.0]
    detector = GpuDetector(nvml=nvml, refresh=5, clock=lambda: now[0])

    detector.devices()
    nvml.gpus[0].used_bytes = 40 * GIB
    assert detector.devices()[0][0]["memory_used_mb"] == 1234  # within 5 s: the last reading
    now[0] += 5
    assert detector.devices()[0][0]["memory_used_mb"] == 40 * 1024

    assert nvml.calls.count("nvmlInit") == 1
    assert nvml.calls.count("nvmlDeviceGetCount") == 2


def test_it_falls_back_to_nvidia_smi_when_nvml_cannot_be_initialised(tmp_path: Path) -> None:
    nvml = nvml_two_gpus()
    nvml.fail.add("nvmlInit")  # no driver library, as in a container without it
    detector = GpuDetector(nvml=nvml, nvidia_smi=smi(tmp_path, GOOD_SMI), refresh=0)

    devices, source = detector.devices()
    detector.devices()

    assert source == "nvidia-smi"
    assert [(d["index"], d["uuid"], d["memory_total_mb"]) for d in devices] == [
        (0, H100, 81559),
        (1, L4, 23034),
    ]
    assert nvml.calls.count("nvmlInit") == 1  # not tried again at every heartbeat


def test_an_nvml_error_while_reading_falls_back_to_nvidia_smi_for_that_reading(
    tmp_path: Path,
) -> None:
    nvml = nvml_two_gpus()
    detector = GpuDetector(nvml=nvml, nvidia_smi=smi(tmp_path, GOOD_SMI), refresh=0)
    assert detector.devices()[1] == "nvml"

    nvml.fail.add("nvmlDeviceGetMemoryInfo")  # a GPU that fell off the bus
    assert detector.devices()[1] == "nvidia-smi"

    nvml.fail.clear()
    assert detector.devices()[1] == "nvml"


def test_no_nvml_and_no_nvidia_smi_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    nvml = nvml_two_gpus()
    nvml.fail.add("nvmlInit")

    assert GpuDetector(nvml=nvml).devices() == ([], "")
    assert GpuDetector(use_nvml=False).devices() == ([], "")


def test_it_finds_nvidia_smi_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi(tmp_path, GOOD_SMI)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")

    devices, source = GpuDetector(use_nvml=False).devices()

    assert (len(devices), source) == (2, "nvidia-smi")


# -- nvidia-smi's output ------------------------------------------------------------------------


def test_it_parses_nvidia_smi_output_with_unknown_utilisation_and_a_comma_in_a_name() -> None:
    devices = parse_nvidia_smi(
        GOOD_SMI + "2, GPU-1111, NVIDIA A100-SXM4-80GB, rev 2, 81920, 70000.0, 100\n"
    )

    assert devices[1]["utilization_pct"] is None  # "[N/A]"
    assert devices[2] == {
        "index": 2,
        "uuid": "GPU-1111",
        "name": "NVIDIA A100-SXM4-80GB, rev 2",
        "memory_total_mb": 81920,
        "memory_used_mb": 70000,
        "utilization_pct": 100,
    }


def test_it_skips_garbage_lines_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    output = (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\n"
        f"0, {H100}, NVIDIA H100, 81559, 1234, 5\n"
        "0, GPU-again, the same index twice, 1, 1, 1\n"
        "x, GPU-2, not an index, 100, 1, 1\n"
        "3, GPU-3, memory unknown, [N/A], [N/A], [N/A]\n"
        "4, GPU-4, negative, -5, 1, 1\n"
        "\x00\xff, binary, junk\n"
    )
    with caplog.at_level(logging.WARNING, logger="llmgw.node"):
        devices = parse_nvidia_smi(output)

    assert [d["uuid"] for d in devices] == [H100]
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 6
    assert skipped[0] == (
        'nvidia-smi printed a line that is not a GPU; skipped: "NVIDIA-SMI has failed because '
        "it couldn't communicate with the NVIDIA driver\""
    )


def test_it_clips_out_of_bounds_figures_and_long_texts() -> None:
    (only,) = parse_nvidia_smi(f"0, GPU-1, {'N' * 500}, 1000, 50, 250\n")

    assert len(only["name"]) == gpus.MAX_NAME
    assert only["utilization_pct"] == 100


def test_it_reads_a_bounded_part_of_a_huge_output_and_reports_at_most_64_devices(
    tmp_path: Path,
) -> None:
    # 200 000 device lines (about 9 MB): read up to 64 KiB, at most 64 devices reported.
    program = fake_program(
        tmp_path,
        "nvidia-smi",
        'i=0; while [ $i -lt 200000 ]; do echo "$i, GPU-$i, NVIDIA Fake, 1000, 1, 1"; '
        "i=$((i+1)); done\n",
    )
    started = time.monotonic()

    devices = gpus.run_nvidia_smi(program, timeout=60)

    assert len(devices) == gpus.MAX_DEVICES
    assert devices[-1]["index"] == 63
    assert time.monotonic() - started < 60


def test_a_hanging_nvidia_smi_is_killed_and_not_asked_again_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gpus, "SMI_TIMEOUT_SECONDS", 0.5)
    program = fake_program(tmp_path, "nvidia-smi", f'echo $$ > "{tmp_path}/pid"\nsleep 60\n')
    now = [0.0]
    detector = GpuDetector(use_nvml=False, nvidia_smi=program, refresh=0, clock=lambda: now[0])

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="llmgw.node"):
        assert detector.devices() == ([], "")
    assert time.monotonic() - started < 5
    pid = int((tmp_path / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists()  # killed, with its group
    assert "nvidia-smi did not answer within 0.5 s; trying it again in 60 s" in caplog.text

    (tmp_path / "pid").unlink()
    now[0] += 30
    detector.devices()
    assert not (tmp_path / "pid").exists()  # within the minute: not run again
    now[0] += 31
    detector.devices()
    assert (tmp_path / "pid").exists()


def test_a_failing_nvidia_smi_is_no_gpu(tmp_path: Path) -> None:
    program = fake_program(tmp_path, "nvidia-smi", "echo 'No devices were found'\nexit 6\n")

    assert GpuDetector(use_nvml=False, nvidia_smi=program).devices() == ([], "")


# -- declared GPUs ------------------------------------------------------------------------------


def test_declared_gpus_replace_detection() -> None:
    nvml = nvml_two_gpus()
    detector = GpuDetector(nvml=nvml, declared=(3, 7.5))

    devices, source = detector.devices()

    assert source == "flags"
    assert devices == declared_devices(3, 7.5)
    assert devices[2] == {
        "index": 2,
        "uuid": "",
        "name": "declared",
        "memory_total_mb": 7680,
        "memory_used_mb": 0,
        "utilization_pct": None,
    }
    assert capacity(devices) == (3, 7.5)
    assert nvml.calls == []  # nothing detected


def test_declaring_no_gpus_reports_none_whatever_is_there() -> None:
    assert GpuDetector(nvml=nvml_two_gpus(), declared=(0, 0)).devices() == ([], "flags")
    assert capacity([]) == (0, 0)


def node_config(monkeypatch: pytest.MonkeyPatch, *options: str) -> NodeConfig:
    monkeypatch.setenv("LLMGW_NODE_TOKEN", "t")
    args = build_parser().parse_args(
        ["node", "--server", "http://cp", "--memory", "8", "--cores", "2", *options]
    )
    return config_from_args(args)


def test_the_command_line_declares_gpus_only_with_their_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    detected = node_config(monkeypatch)
    assert (detected.gpus, detected.gpu_memory_gb) == (None, None)
    declared = node_config(monkeypatch, "--gpus", "2", "--gpu-memory", "24")
    assert (declared.gpus, declared.gpu_memory_gb) == (2, 24)
    assert node_config(monkeypatch, "--gpus", "0").gpus == 0

    with pytest.raises(SystemExit) as refused:
        node_config(monkeypatch, "--gpus", "2")
    assert str(refused.value) == (
        "llmgw node: --gpus 2 needs --gpu-memory GB, the memory of each GPU."
    )
    with pytest.raises(SystemExit) as refused:
        node_config(monkeypatch, "--gpu-memory", "24")
    assert str(refused.value) == (
        "llmgw node: --gpu-memory goes with --gpus N (the GPUs it describes); without --gpus "
        "the GPUs and their memory are detected."
    )
