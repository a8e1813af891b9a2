"""A node's GPUs as its heartbeat reports them: checked, stored, believed only as far as its
capacity is, and shown per device (reserved by llmgw, used by others, free) in the API, `llmgw
ctl nodes` and the Nodes page."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from rest_framework.test import APIClient

from fleet.models import Node, Replica

pytestmark = [pytest.mark.django_db]

GIB_MB = 1024


def gpu(index: int, *, total_gb: float = 80, used_gb: float = 0, **more: Any) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{index:04d}-aaaa",
        "name": "NVIDIA H100",
        "memory_total_mb": int(total_gb * GIB_MB),
        "memory_used_mb": int(used_gb * GIB_MB),
        "utilization_pct": 7,
        **more,
    }


def beat(devices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {
        "capacity": {
            "memory_gb": 64,
            "cores": 16,
            "gpus": len(devices),
            "gpu_memory_gb": min((d["memory_total_mb"] for d in devices), default=0) / GIB_MB,
        },
        "devices": devices,
        "devices_source": "nvml",
        "engine_backends": ["CPU", "CUDA"],
        "replicas": [],
        **more,
    }


def node_client(api: Any, name: str = "gpu-1") -> APIClient:
    token = api("staff").post("/api/v1/nodes", {"name": name}, format="json").json()["token"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def test_the_devices_a_heartbeat_reports_are_kept_and_shown_per_device(api: Any) -> None:
    node = node_client(api)
    body = beat([gpu(1, used_gb=30), gpu(0, used_gb=2)])
    assert node.post("/api/v1/node/heartbeat", body, format="json").status_code == 200
    stored = Node.objects.get()
    assert [d["index"] for d in stored.devices] == [0, 1]  # in index order
    assert stored.devices_source == "nvml" and stored.engine_backends == ["CPU", "CUDA"]
    # llmgw holds 20 GB on device 0 through a replica; 30 GB of device 1 is someone else's.
    Replica.objects.create(
        node=stored, model_name="m", profile="gpu", gpus=1, gpu_memory_gb=20, devices=[0]
    )
    view = api("alice").get("/api/v1/nodes").json()[0]
    zero, one = view["devices"]
    assert zero == {
        "index": 0,
        "uuid": "GPU-0000-aaaa",
        "name": "NVIDIA H100",
        "memory_total_gb": 80,
        "reserved_gb": 20,
        "used_by_others_gb": 0,  # the 2 GB seen in use are within llmgw's 20
        "used_gb": 2,
        "free_gb": 60,
        "utilization_pct": 7,
    }
    assert one["reserved_gb"] == 0 and one["used_by_others_gb"] == 30 and one["free_gb"] == 50
    assert view["engine_backends"] == ["CPU", "CUDA"] and view["devices_source"] == "nvml"


def test_a_replica_on_two_devices_reserves_half_on_each(api: Any) -> None:
    node = node_client(api)
    node.post("/api/v1/node/heartbeat", beat([gpu(0), gpu(1)]), format="json")
    Replica.objects.create(
        node=Node.objects.get(), model_name="m", profile="gpu", gpus=2, gpu_memory_gb=30,
        devices=[0, 1],
    )  # fmt: skip
    view = api("alice").get("/api/v1/nodes").json()[0]
    assert [d["reserved_gb"] for d in view["devices"]] == [15, 15]
    assert [d["free_gb"] for d in view["devices"]] == [65, 65]


def test_a_node_is_believed_only_for_as_many_devices_as_it_registered(api: Any) -> None:
    node = node_client(api)
    node.post("/api/v1/node/heartbeat", beat([gpu(0)]), format="json")
    # The same node now claims four GPUs: capacity is believed up to what it registered (one).
    answer = node.post(
        "/api/v1/node/heartbeat", beat([gpu(0), gpu(1), gpu(2), gpu(3)]), format="json"
    ).json()
    assert any("GPU" in w for w in answer["warnings"])
    assert [d["index"] for d in Node.objects.get().devices] == [0]


@pytest.mark.parametrize(
    "devices, message",
    [
        ([gpu(0), gpu(0)], "two devices have the same index"),
        ([gpu(0, name="x" * 201)], "devices[0].name"),
        ([{**gpu(0), "memory_total_mb": "lots"}], "devices[0].memory_total_mb"),
        ([{**gpu(0), "memory_total_mb": True}], "devices[0].memory_total_mb"),
        ([{**gpu(0), "memory_total_mb": 10**12}], "devices[0].memory_total_mb"),
        ([{**gpu(0), "utilization_pct": 101}], "devices[0].utilization_pct"),
        ([{**gpu(0), "index": -1}], "devices[0].index"),
        ([gpu(i, total_gb=1) for i in range(65)], "devices"),
        ("GPU", "devices"),
    ],
)
def test_a_bad_device_report_gets_400_and_changes_nothing(
    api: Any, devices: Any, message: str
) -> None:
    node = node_client(api)
    body = beat([gpu(0)])
    body["devices"] = devices
    response = node.post("/api/v1/node/heartbeat", body, format="json")
    assert response.status_code == 400, response.content
    assert message in response.json()["detail"]
    stored = Node.objects.get()
    assert stored.last_heartbeat is None and stored.devices == []


def test_too_many_backends_or_an_unknown_source_is_refused(api: Any) -> None:
    node = node_client(api)
    response = node.post(
        "/api/v1/node/heartbeat", beat([gpu(0)], engine_backends=["CPU"] * 17), format="json"
    )
    assert response.status_code == 400 and "engine_backends" in response.json()["detail"]
    response = node.post(
        "/api/v1/node/heartbeat", beat([gpu(0)], devices_source="guesswork"), format="json"
    )
    assert response.status_code == 400 and "devices_source" in response.json()["detail"]


def test_used_above_total_counts_as_full(api: Any) -> None:
    node = node_client(api)
    body = beat([{**gpu(0, total_gb=10), "memory_used_mb": 11 * GIB_MB}])
    assert node.post("/api/v1/node/heartbeat", body, format="json").status_code == 200
    (device,) = api("alice").get("/api/v1/nodes").json()[0]["devices"]
    assert device["used_gb"] == 10 and device["free_gb"] == 0


def test_an_agent_that_reports_no_devices_leaves_none(api: Any) -> None:
    node = node_client(api)
    node.post("/api/v1/node/heartbeat", beat([gpu(0)]), format="json")
    old_agent = {"capacity": {"memory_gb": 64, "cores": 16}, "replicas": []}
    assert node.post("/api/v1/node/heartbeat", old_agent, format="json").status_code == 200
    stored = Node.objects.get()
    assert stored.devices == [] and stored.engine_backends == [] and stored.devices_source == ""


def test_ctl_nodes_prints_each_device_and_warns_of_a_cpu_only_engine(api: Any, capsys: Any) -> None:
    from llmgw.ctl.nodes import cmd_nodes

    node_client(api, "gpu-1").post(
        "/api/v1/node/heartbeat", beat([gpu(0, used_gb=30)]), format="json"
    )
    node_client(api, "gpu-2").post(
        "/api/v1/node/heartbeat",
        beat([gpu(0, total_gb=24)], engine_backends=["CPU"]),
        format="json",
    )

    class Client:
        def get(self, path: str) -> Any:
            return api("alice").get(f"/api/v1/{path}").json()

    cmd_nodes(Client(), argparse.Namespace(json=False))  # type: ignore[arg-type]
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    header = next(line for line in lines if line.startswith("NODE"))
    assert header.split() == ["NODE", "GPU", "NAME", "MEMORY", "LLMGW", "OTHERS", "FREE", "BUSY"]
    row = next(line for line in lines if line.startswith("gpu-1 ") and "NVIDIA" in line)
    assert "80 GB" in row and "30 GB" in row and "50 GB" in row and "7%" in row
    assert "Node gpu-2 has GPUs but its engine is built for the CPU only" in printed
    assert "Node gpu-1 has GPUs but" not in printed


def test_the_nodes_page_shows_each_device(api: Any, client: Any, users: Any) -> None:
    node_client(api).post(
        "/api/v1/node/heartbeat",
        beat([gpu(0, used_gb=30)], engine_backends=["CPU"]),
        format="json",
    )
    client.force_login(users["alice"])
    page = client.get("/nodes/").content.decode()
    assert "GPU 0" in page
    assert "0 GB reserved by llmgw, 30 GB used by other programs, 50 GB free of 80 GB" in page
    assert "Its engine is built for the CPU only" in page
