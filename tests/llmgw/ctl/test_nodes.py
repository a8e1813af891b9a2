"""`llmgw ctl node` (llmgw/ctl/nodes.py) against a running server: the address allow-list and
accepting a node's capacity."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rest_framework.test import APIClient

from fleet.models import Node
from tests.support.ctl import Ctl, ctl_as

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


def beat(token: str, memory_gb: float) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {"capacity": {"memory_gb": memory_gb, "cores": 4}}
    assert client.post("/api/v1/node/heartbeat", body, format="json").status_code == 200


def test_node_add_with_an_allow_list_and_node_set(ctl: Any) -> None:
    code, out, err = ctl(
        "staff", "node", "add", "gpu-1", "--address-allow", "10.1.0.0/16, 10.2.0.7"
    )
    assert code == 0, err
    assert "It may report its engines at: 10.1.0.0/16, 10.2.0.7, or where it connects from." in out
    token = out.split("shown only now:")[1].split()[0]
    assert f"  LLMGW_NODE_TOKEN={token} llmgw node --server " in out
    assert Node.objects.get().address_allow == ["10.1.0.0/16", "10.2.0.7/32"]

    code, out, _ = ctl("staff", "node", "set", "gpu-1", "--address-allow", "192.168.0.0/24")
    assert out.splitlines() == [
        "Node gpu-1 may report its engines at: 192.168.0.0/24.",
        "Its next heartbeat is checked against this.",
    ]
    code, out, _ = ctl("staff", "node", "set", "gpu-1", "--address-allow", "")
    assert out.splitlines()[0] == (
        "Node gpu-1 may report its engines at: only the address it connects from."
    )
    code, _, err = ctl("staff", "node", "set", "gpu-1", "--address-allow", "10.0.0.0/99")
    assert code == 1 and "'10.0.0.0/99' is not a network like 10.0.0.0/24" in err
    code, _, err = ctl("alice", "node", "set", "gpu-1", "--address-allow", "0.0.0.0/0")
    assert code == 1 and "Only staff may change nodes" in err
    assert Node.objects.get().address_allow == []


def test_node_accept_capacity_prints_what_is_now_believed(ctl: Any) -> None:
    code, out, _ = ctl("staff", "node", "add", "gpu-1")
    token = out.split("shown only now:")[1].split()[0]
    beat(token, 8)
    beat(token, 64)
    code, out, _ = ctl("alice", "nodes")
    assert out.splitlines()[1].split()[2:4] == ["8", "GB,"]
    assert out.splitlines()[-1].startswith("Node gpu-1 reports 64 GB of memory, more than the 8 GB")
    code, out, _ = ctl("alice", "nodes", "--json")
    assert json.loads(out)[0]["reported"]["memory_gb"] == 64

    code, _, err = ctl("alice", "node", "accept-capacity", "gpu-1")
    assert code == 1 and "Only staff may accept a node's capacity" in err
    code, out, _ = ctl("staff", "node", "accept-capacity", "gpu-1")
    assert out.strip() == "Node gpu-1: placement now counts on 64 GB, 4 cores, as it reports."
    assert Node.objects.get().memory_gb == 64
