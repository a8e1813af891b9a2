"""GPU profiles through a reconcile pass and the heartbeat answer, on the database: the devices a
node reports (one of them mostly held by another program), the device a replica is placed on,
and the refusal of a node whose engine has no GPU backend."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.models import Node, Replica
from fleet.reconciler import reconcile_pass
from fleet.services import replica_order

pytestmark = pytest.mark.django_db

GPU = {"name": "gpu", "memory_gb": 1, "cores": 1, "gpus": 1, "gpu_memory_gb": 6}


def device(index: int, total_mb: int, used_mb: int, uuid: str = "") -> dict[str, Any]:
    return {
        "index": index,
        "uuid": uuid,
        "name": "NVIDIA L4",
        "memory_total_mb": total_mb,
        "memory_used_mb": used_mb,
        "utilization_pct": 0,
    }


def gpu_node(fleet: Any, name: str, devices: list[dict[str, Any]], backends: list[str]) -> Node:
    """A node as its agent reports it (the heartbeat's storage of these is another piece's:
    here they are written directly)."""
    node = fleet.node(name, memory_gb=16, cores=4)
    node.devices, node.devices_source, node.engine_backends = devices, "nvml", backends
    node.save(update_fields=["devices", "devices_source", "engine_backends"])
    return node


def test_a_gpu_replica_goes_to_the_emptier_device_and_the_node_is_told_which(fleet: Any) -> None:
    # Device 0 has 24 GB of which another program holds 20; device 1 is nearly empty.
    node = gpu_node(
        fleet,
        "g",
        [device(0, 24576, 20480, "GPU-aaaa"), device(1, 24576, 512, "GPU-bbbb")],
        ["CPU", "CUDA"],
    )
    fleet.add("chat", profiles=[{**GPU, "gpu_layers": 20}])

    report = reconcile_pass()

    [replica] = Replica.objects.all()
    assert report.started == [str(replica.pk)] and report.unplaced == []
    assert replica.devices == [1] and replica.gpus == 1 and replica.gpu_memory_gb == 6
    assert replica.spec["gpu_layers"] == 20
    order = replica_order(replica, node)
    assert {k: order[k] for k in ("devices", "device_uuids", "gpu_layers", "tensor_split")} == {
        "devices": [1],
        "device_uuids": ["GPU-bbbb"],
        "gpu_layers": 20,
        "tensor_split": [],
    }
    # The heartbeat's answer carries the same order.
    [answered] = fleet.beat("g", states={})["replicas"]
    assert (answered["devices"], answered["gpu_layers"]) == ([1], 20)


def test_a_replica_of_two_gpus_is_split_evenly_and_told_so(fleet: Any) -> None:
    node = gpu_node(
        fleet,
        "g",
        [device(0, 16384, 0, "GPU-a"), device(1, 16384, 0, "GPU-b"), device(2, 16384, 15000)],
        ["CPU", "CUDA"],
    )
    fleet.add("big", profiles=[{**GPU, "gpus": 2, "gpu_memory_gb": 10}])
    reconcile_pass()
    [replica] = Replica.objects.all()
    # gpu_memory_gb is per GPU in a profile; the replica holds 10 on each of two.
    assert replica.devices == [0, 1] and replica.gpu_memory_gb == 20
    order = replica_order(replica, node)
    assert order["device_uuids"] == ["GPU-a", "GPU-b"]
    assert order["tensor_split"] == [0.5, 0.5] and order["gpu_layers"] == "all"


def test_a_cpu_replica_is_told_no_devices(fleet: Any) -> None:
    node = gpu_node(fleet, "g", [device(0, 24576, 0)], ["CPU", "CUDA"])
    fleet.add("chat")
    reconcile_pass()
    order = replica_order(Replica.objects.get(), node)
    assert (order["devices"], order["device_uuids"], order["gpu_layers"]) == ([], [], 0)
    assert order["tensor_split"] == [] and "gpu_layers" not in Replica.objects.get().spec


def test_a_gpu_profile_is_refused_on_a_node_whose_engine_has_no_gpu_backend(fleet: Any) -> None:
    gpu_node(fleet, "cpu-box", [device(0, 24576, 0)], ["CPU"])
    fleet.add("chat", profiles=[GPU])

    report = reconcile_pass()

    assert not Replica.objects.exists()
    [unplaced] = report.unplaced
    assert unplaced.reason.startswith(
        "no node has a GPU engine (an engine built with CUDA): profile gpu needs 1 GPU, and "
        "the engine of every schedulable node (cpu-box) has only its CPU backend"
    )
    assert "LLMGW_ENGINE=cuda make setup" in unplaced.reason


def test_a_node_that_lists_no_devices_gets_its_declared_gpus_as_devices(fleet: Any) -> None:
    node = gpu_node(fleet, "old", [], ["CPU", "CUDA"])
    Node.objects.filter(pk=node.pk).update(gpus=2, gpu_memory_gb=8)
    fleet.add("chat", profiles=[GPU], min_replicas=2)
    reconcile_pass()
    assert sorted(r.devices for r in Replica.objects.all()) == [[0], [1]]


def test_reported_devices_are_checked_before_they_are_believed(fleet: Any) -> None:
    hostile = [
        "not a device",
        {"index": "0", "memory_total_mb": 24576},
        {"index": True, "memory_total_mb": 24576},
        {"index": 3, "memory_total_mb": -1},
        {"index": 4, "memory_total_mb": 8192, "memory_used_mb": "lots"},
        {"index": 5, "memory_total_mb": 8192, "memory_used_mb": 10**9},  # used: all of it
        device(6, 8192, 0),
    ]
    gpu_node(fleet, "g", hostile, ["CPU", "CUDA"])
    fleet.add("chat", profiles=[GPU], min_replicas=2)
    report = reconcile_pass()
    # Only devices 5 and 6 stand, and 5 is full.
    assert [r.devices for r in Replica.objects.all()] == [[6]]
    [unplaced] = report.unplaced
    assert "GPU 5: 8 GB, 0 GB reserved by llmgw, 8 GB used by other programs, 0 GB free" in (
        unplaced.reason
    )
