"""A replica's GPU fields in the control plane's answer (llmgw/node/spec.py): read when they
make sense, the whole answer refused when they do not, a CPU replica when they are absent."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.node.spec import AnswerError, ReplicaSpec, parse_answer

UUID_A = "GPU-5a1f3c0e-8d2b-4f6a-9c3e-1b2d3e4f5a6b"
UUID_B = "GPU-0b9e8d7c-6b5a-4c3d-8e2f-1a0b9c8d7e6f"


def order(**fields: Any) -> dict[str, Any]:
    return {"id": "r1", "model": "tiny-chat", "source": "http://mirror/model.gguf", **fields}


def test_a_replica_without_gpu_fields_is_a_cpu_replica() -> None:
    spec = ReplicaSpec.from_json(order())

    assert (spec.devices, spec.device_uuids, spec.gpu_layers, spec.tensor_split) == ((), (), 0, ())
    assert not spec.on_gpus
    assert ReplicaSpec.from_json(order(devices=[], gpu_layers=0, tensor_split=[])) == spec


def test_a_replica_on_two_devices_reads_and_round_trips() -> None:
    spec = ReplicaSpec.from_json(
        order(
            devices=[1, 0],
            device_uuids=[UUID_B, UUID_A],
            gpu_layers="all",
            tensor_split=[0.75, 0.25],
        )
    )

    assert spec.on_gpus
    assert (spec.devices, spec.device_uuids, spec.gpu_layers, spec.tensor_split) == (
        (1, 0),
        (UUID_B, UUID_A),
        "all",
        (0.75, 0.25),
    )
    # As state.json keeps it, for an agent that adopts the engine.
    assert ReplicaSpec.from_json(spec.to_json()) == spec


def test_devices_without_gpu_layers_offload_all_and_unknown_uuids_are_empty() -> None:
    spec = ReplicaSpec.from_json(order(devices=[0], device_uuids=[""]))

    assert (spec.gpu_layers, spec.device_uuids) == ("all", ("",))


def test_devices_with_no_layers_offloaded_is_not_on_gpus() -> None:
    assert not ReplicaSpec.from_json(order(devices=[0], gpu_layers=0)).on_gpus


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"devices": "0"}, "devices is not a list of at most 64 indices"),
        ({"devices": list(range(65))}, "devices is not a list of at most 64 indices"),
        ({"devices": [0, True]}, "a device index is True, not a whole number 0-63"),
        ({"devices": [-1]}, "a device index is -1, not a whole number 0-63"),
        ({"devices": [64]}, "a device index is 64, not a whole number 0-63"),
        ({"devices": [0.0]}, "a device index is 0.0, not a whole number 0-63"),
        ({"devices": [1, 1]}, "devices lists one device twice"),
        (
            {"devices": [0, 1], "device_uuids": [UUID_A]},
            "device_uuids is not a list with one entry per device",
        ),
        (
            {"devices": [0], "device_uuids": ["GPU-1,GPU-2"]},
            "a device uuid is 'GPU-1,GPU-2', not a GPU's UUID",
        ),
        (
            {"devices": [0], "device_uuids": ["x" * 101]},
            f"a device uuid is {'x' * 101!r}, not a GPU's UUID",
        ),
        ({"devices": [0], "device_uuids": [7]}, "a device uuid is '7', not a GPU's UUID"),
        ({"devices": [0], "gpu_layers": "most"}, "gpu_layers is 'most', not \"all\""),
        ({"devices": [0], "gpu_layers": -1}, 'gpu_layers is -1, not "all"'),
        ({"devices": [0], "gpu_layers": 10**9}, 'gpu_layers is 1000000000, not "all"'),
        ({"gpu_layers": "all"}, "gpu_layers is 'all' but no devices are given"),
        (
            {"devices": [0], "tensor_split": [1.0]},
            "tensor_split has 1 entries for 1 devices (one per device, over 2 or more)",
        ),
        (
            {"devices": [0, 1], "tensor_split": [1.0, 2.0, 3.0]},
            "tensor_split has 3 entries for 2 devices",
        ),
        (
            {"devices": [0, 1], "tensor_split": [1.0, float("nan")]},
            "a tensor_split share is nan, not 0-1e+06",
        ),
        (
            {"devices": [0, 1], "tensor_split": [1.0, "2"]},
            "a tensor_split share is '2', not 0-1e+06",
        ),
        (
            {"devices": [0, 1], "tensor_split": [0, 0]},
            "tensor_split gives the devices no share of the layers",
        ),
        ({"devices": [0, 1], "tensor_split": {"0": 1}}, "tensor_split is not a list"),
    ],
)
def test_bad_gpu_fields_refuse_the_whole_answer(fields: dict[str, Any], reason: str) -> None:
    answer = {"replicas": [order(id="fine"), order(**fields)]}

    with pytest.raises(AnswerError) as refused:
        parse_answer(answer)

    assert str(refused.value).startswith(f"replica r1: {reason}")
