"""What the control plane believes of a node (fleet/trust.py): its address is where it connects
from or in its staff-given allow-list, its replicas' ports lie in the range it declared, and its
capacity is bounded by the operator's limits and by what it first registered. Driven through the
node-facing API as agents drive it, with the connecting address set as the web would see it."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from fleet import trust
from fleet.models import Node, Replica
from fleet.reconciler import reconcile_pass
from gateway.routing import read_replicas

pytestmark = [pytest.mark.django_db]

HEARTBEAT = "/api/v1/node/heartbeat"
CAPACITY = {"memory_gb": 8, "cores": 4}


def add_node(api: Any, name: str = "n1", **fields: Any) -> str:
    response = api("staff").post("/api/v1/nodes", {"name": name, **fields}, format="json")
    assert response.status_code == 201, response.json()
    return str(response.json()["token"])


def beat(token: str, *, peer: str = "127.0.0.1", **report: Any) -> Any:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {"capacity": CAPACITY, **report}
    return client.post(HEARTBEAT, body, format="json", REMOTE_ADDR=peer)


def staff_view(api: Any, name: str = "n1") -> dict[str, Any]:
    (view,) = [n for n in api("staff").get("/api/v1/nodes").json() if n["name"] == name]
    return dict(view)


def add_model(api: Any, name: str = "chat", memory_gb: float = 1) -> None:
    from tests.factories import definition

    body = definition(name=name, profiles=[{"name": "cpu", "memory_gb": memory_gb}])
    response = api("alice").post("/api/v1/models?source_check=false", body, format="json")
    assert response.status_code == 201, response.json()


# -- 1. the address ------------------------------------------------------------------------------


def test_it_refuses_a_node_that_reports_another_machine_as_its_address(api: Any) -> None:
    token = add_node(api)
    response = beat(token, peer="10.0.0.5", address="169.254.169.254")
    assert response.status_code == 403
    assert response.json() == {
        "detail": (
            "This node reports its engines at 169.254.169.254, but it connects from 10.0.0.5 "
            "and 169.254.169.254 is in none of the networks staff allowed for it (none); the "
            "gateway sends requests only to a node's own address. Start its agent with --address "
            "10.0.0.5 (or 0.0.0.0, to be reached where it connects from), or, for a node behind "
            "NAT or with several interfaces, have staff allow that address: llmgw ctl node set n1 "
            "--address-allow 169.254.169.254."
        ),
        "code": "address_not_allowed",
    }
    node = Node.objects.get()
    assert (node.last_heartbeat, node.address, node.memory_gb) == (None, "127.0.0.1", 0)


def test_it_refuses_loopback_from_a_node_on_another_machine(api: Any) -> None:
    """127.0.0.1 from another machine would send the gateway's requests to the control
    plane's own machine."""
    token = add_node(api)
    response = beat(token, peer="10.0.0.5", address="127.0.0.1")
    assert response.status_code == 403
    assert response.json()["code"] == "address_not_allowed"
    assert Node.objects.get().last_heartbeat is None


def test_it_refuses_a_host_name(api: Any) -> None:
    token = add_node(api)
    response = beat(token, peer="10.0.0.5", address="gpu-1.internal")
    assert response.status_code == 403
    assert response.json()["detail"].startswith(
        "This node reports its engines at 'gpu-1.internal', which is not an IP address;"
    )


@pytest.mark.parametrize("reported", [None, "", "0.0.0.0", "::"])
def test_a_node_without_an_address_is_reached_where_it_connects_from(
    api: Any, reported: str | None
) -> None:
    token = add_node(api)
    report = {} if reported is None else {"address": reported}
    assert beat(token, peer="10.0.0.5", **report).status_code == 200
    assert Node.objects.get().address == "10.0.0.5"
    assert staff_view(api)["address"] == "10.0.0.5"


@pytest.mark.parametrize(
    "reported, peer",
    [("127.0.0.1", "127.0.0.1"), ("127.0.0.1", "::1"), ("10.0.0.5", "::ffff:10.0.0.5")],
)
def test_a_node_reporting_the_address_it_connects_from_is_believed(
    api: Any, reported: str, peer: str
) -> None:
    """The local node of the run command and the tests' agents report 127.0.0.1 and connect
    over loopback, whichever loopback address the name localhost gives them."""
    token = add_node(api)
    assert beat(token, peer=peer, address=reported).status_code == 200
    assert Node.objects.get().address == reported


def test_a_node_on_the_control_planes_machine_may_name_loopback_from_its_outward_address(
    api: Any, outward_address: str
) -> None:
    """The run command's local node reaches the control plane at LLMGW_PUBLIC_URL; when that is
    the machine's public name, the node connects from the machine's own address."""
    token = add_node(api)
    assert beat(token, peer=outward_address, address="127.0.0.1").status_code == 200
    assert Node.objects.get().address == "127.0.0.1"


def test_staff_allow_a_node_behind_nat_its_inner_address(api: Any) -> None:
    token = add_node(api, address_allow=["192.168.7.0/24", "10.9.9.9"])
    assert staff_view(api)["address_allow"] == ["192.168.7.0/24", "10.9.9.9/32"]
    assert beat(token, peer="203.0.113.7", address="192.168.7.20").status_code == 200
    assert Node.objects.get().address == "192.168.7.20"

    response = api("staff").patch("/api/v1/nodes/n1", {"address_allow": []}, format="json")
    assert response.status_code == 200 and response.json()["address_allow"] == []
    refused = beat(token, peer="203.0.113.7", address="192.168.7.20")
    assert refused.status_code == 403
    assert "in none of the networks staff allowed for it (none)" in refused.json()["detail"]


def test_only_staff_change_a_nodes_allow_list_and_only_to_networks(api: Any) -> None:
    add_node(api)
    response = api("alice").patch(
        "/api/v1/nodes/n1", {"address_allow": ["0.0.0.0/0"]}, format="json"
    )
    assert response.status_code == 403
    assert response.json()["detail"] == "Only staff may change nodes; ask an administrator."
    response = api("staff").patch(
        "/api/v1/nodes/n1", {"address_allow": ["10.0.0.0/33"]}, format="json"
    )
    assert response.status_code == 400
    assert response.json() == {
        "detail": (
            "The address allow-list was refused: '10.0.0.0/33' is not a network like 10.0.0.0/24 "
            "or an address like 10.0.0.5. List the networks (CIDR) or addresses the node may "
            "report as its engines' address, comma-separated."
        ),
        "code": "address_allow_invalid",
    }
    response = api("staff").post(
        "/api/v1/nodes", {"name": "n2", "address_allow": ["nope"]}, format="json"
    )
    assert response.status_code == 400 and not Node.objects.filter(name="n2").exists()
    assert Node.objects.get(name="n1").address_allow == []


def test_addresses_and_allow_lists_are_shown_to_staff_only(api: Any) -> None:
    token = add_node(api, address_allow=["10.1.0.0/16"])
    beat(token)
    view = api("alice").get("/api/v1/nodes").json()[0]
    assert (view["address"], view["address_allow"], view["port_range"]) == (None, None, None)
    assert staff_view(api)["port_range"] == {"first": 41000, "last": 41999}


# -- 2. the ports --------------------------------------------------------------------------------


def placed_replica(api: Any, token: str, **report: Any) -> Replica:
    assert beat(token, **report).status_code == 200
    add_model(api)
    reconcile_pass()
    return Replica.objects.get()


def report_ready(token: str, replica: Replica, port: int, **report: Any) -> Any:
    ready = {"id": str(replica.pk), "state": "ready", "port": port}
    return beat(token, replicas=[ready], **report)


def test_a_replica_on_a_port_outside_its_nodes_range_is_failed_and_not_routed(api: Any) -> None:
    ports = {"first": 42000, "last": 42099}
    token = add_node(api)
    replica = placed_replica(api, token, port_range=ports)
    assert report_ready(token, replica, 22, port_range=ports).status_code == 200
    replica.refresh_from_db()
    assert (replica.state, replica.port, replica.routable) == ("failed", None, False)
    assert replica.message == (
        "its node reported it on port 22, outside the ports 42000-42099 the node declared for "
        "its engines; it is not routed"
    )
    assert read_replicas() == {}
    shown = api("alice").get("/api/v1/models/chat/target").json()["replicas"][0]
    assert shown["message"] == replica.message


def test_a_replica_inside_its_nodes_range_is_routed(api: Any) -> None:
    ports = {"first": 42000, "last": 42099}
    token = add_node(api)
    replica = placed_replica(api, token, port_range=ports)
    assert report_ready(token, replica, 42050, port_range=ports).status_code == 200
    (candidate,) = read_replicas()["chat"]
    assert candidate.endpoint == "http://127.0.0.1:42050"


def test_a_node_that_declares_no_range_has_the_agents_default(api: Any) -> None:
    token = add_node(api)
    replica = placed_replica(api, token)
    report_ready(token, replica, 42000)
    replica.refresh_from_db()
    assert replica.state == "failed" and "outside the ports 41000-41999" in replica.message


def test_a_replica_on_the_control_planes_own_port_is_not_routed(api: Any, settings: Any) -> None:
    """On the control plane's machine, a replica "on" the gateway's port would have the
    gateway send its requests to itself."""
    settings.LLMGW_PUBLIC_URL = "http://127.0.0.1:41500"
    token = add_node(api)
    replica = placed_replica(api, token)
    report_ready(token, replica, 41500)
    replica.refresh_from_db()
    assert replica.state == "failed" and "where the control plane itself listens" in replica.message


@pytest.mark.parametrize(
    "ports, detail",
    [
        (
            {"first": 22, "last": 41999},
            "This node declares the ports 22-41999 for its engines, but nodes may use only "
            "1024-65535 here (LLMGW_NODE_PORT_MIN, LLMGW_NODE_PORT_MAX). Start its agent with a "
            "--port-range within 1024-65535.",
        ),
        (
            {"first": 42000, "last": 41000},
            "This node declares the ports 42000-41000, whose first is above its last. Give its "
            "agent a --port-range like 41000-41999.",
        ),
    ],
)
def test_a_node_declaring_ports_it_may_not_use_is_refused(
    api: Any, ports: dict[str, int], detail: str
) -> None:
    token = add_node(api)
    response = beat(token, port_range=ports)
    assert response.status_code == 400 and response.json()["detail"] == detail
    assert Node.objects.get().last_heartbeat is None


def test_the_operator_narrows_the_ports_nodes_may_declare(api: Any, settings: Any) -> None:
    settings.LLMGW_NODE_PORT_MIN, settings.LLMGW_NODE_PORT_MAX = 41000, 41999
    token = add_node(api)
    assert beat(token, port_range={"first": 41000, "last": 41999}).status_code == 200
    response = beat(token, port_range={"first": 41000, "last": 50000})
    assert response.status_code == 400 and response.json()["code"] == "port_range_not_allowed"
    assert (Node.objects.get().port_first, Node.objects.get().port_last) == (41000, 41999)


# -- 3. the capacity -----------------------------------------------------------------------------


def test_capacity_above_the_operators_limit_is_refused_whole(api: Any) -> None:
    token = add_node(api)
    response = beat_capacity(token, memory_gb=1_000_000, cores=4)
    assert response.status_code == 400
    assert response.json() == {
        "detail": (
            "This node reports 1e+06 GB of memory (at most 4096 GB of memory, "
            "LLMGW_NODE_MAX_MEMORY_GB): more than this control plane takes from one node. Start "
            "its agent with the machine's real figures (--memory, --cores, --gpus, --gpu-memory), "
            "or have the operator raise the limit."
        ),
        "code": "capacity_over_limit",
    }
    node = Node.objects.get()
    assert (node.last_heartbeat, node.memory_gb, node.registered_capacity) == (None, 0, None)


def beat_capacity(token: str, **capacity: Any) -> Any:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client.post(HEARTBEAT, {"capacity": capacity}, format="json", REMOTE_ADDR="127.0.0.1")


def test_the_operator_sets_the_limits(api: Any, settings: Any) -> None:
    settings.LLMGW_NODE_MAX_CORES, settings.LLMGW_NODE_MAX_GPUS = 16, 2
    token = add_node(api)
    response = beat_capacity(token, memory_gb=8, cores=64, gpus=8, gpu_memory_gb=80)
    assert response.status_code == 400
    assert response.json()["detail"].startswith(
        "This node reports 64 cores (at most 16 cores, LLMGW_NODE_MAX_CORES), 8 GPUs (at most 2 "
        "GPUs, LLMGW_NODE_MAX_GPUS): more than"
    )
    assert beat_capacity(token, memory_gb=8, cores=16, gpus=2, gpu_memory_gb=80).status_code == 200


def test_capacity_grows_past_its_first_report_only_when_staff_accept_it(api: Any) -> None:
    token = add_node(api)
    assert beat_capacity(token, memory_gb=8, cores=4).status_code == 200
    answer = beat_capacity(token, memory_gb=64, cores=4).json()
    warning = (
        "Node n1 reports 64 GB of memory, more than the 8 GB of memory it registered with; "
        "placement counts on 8 GB of memory until staff accept more: `llmgw ctl node "
        "accept-capacity n1` believes what it reports."
    )
    assert answer["warnings"] == [warning]
    view = staff_view(api)
    assert view["capacity"]["memory_gb"] == 8 and view["reported"]["memory_gb"] == 64
    assert view["warnings"] == [warning]

    # Placement counts on what is believed: a 24 GB replica does not fit.
    add_model(api, "big", memory_gb=24)
    reconcile_pass()
    assert not Replica.objects.exists()

    response = api("alice").post("/api/v1/nodes/n1/accept-capacity")
    assert response.status_code == 403
    response = api("staff").post("/api/v1/nodes/n1/accept-capacity")
    assert response.status_code == 200
    assert response.json()["capacity"]["memory_gb"] == 64 and response.json()["warnings"] == []
    reconcile_pass()
    assert Replica.objects.get().model_name == "big"
    assert beat_capacity(token, memory_gb=64, cores=4).json()["warnings"] == []


def test_less_capacity_is_believed_at_once_and_more_again_up_to_the_first_report(api: Any) -> None:
    token = add_node(api)
    beat_capacity(token, memory_gb=8, cores=4)
    beat_capacity(token, memory_gb=2, cores=1)
    assert (Node.objects.get().memory_gb, Node.objects.get().cores) == (2, 1)
    assert beat_capacity(token, memory_gb=8, cores=4).json()["warnings"] == []
    assert (Node.objects.get().memory_gb, Node.objects.get().cores) == (8, 4)


def test_accepting_the_capacity_of_a_node_that_never_reported_is_refused(api: Any) -> None:
    add_node(api)
    response = api("staff").post("/api/v1/nodes/n1/accept-capacity")
    assert response.status_code == 409
    assert response.json()["detail"] == (
        "Node n1 has not reported its capacity yet; start its agent first."
    )


# -- what a heartbeat writes ---------------------------------------------------------------------


def test_a_heartbeat_does_not_undo_what_staff_did_since_it_was_read(api: Any) -> None:
    """A heartbeat writes what its node reports, not the rest of the row it read at the start:
    a cordon, an allow-list or an accepted capacity in between stays."""
    from fleet.services import node_heartbeat

    token = add_node(api)
    beat_capacity(token, memory_gb=8, cores=4)
    beat_capacity(token, memory_gb=16, cores=4)
    stale = Node.objects.get()
    api("staff").post("/api/v1/nodes/n1/cordon")
    api("staff").patch("/api/v1/nodes/n1", {"address_allow": ["10.0.0.0/8"]}, format="json")
    api("staff").post("/api/v1/nodes/n1/accept-capacity")
    report = {"capacity": {"memory_gb": 16, "cores": 4, "gpus": 0, "gpu_memory_gb": 0}}
    node_heartbeat(node=stale, report=report, interval=2, peer="127.0.0.1")
    node = Node.objects.get()
    assert node.cordoned and node.address_allow == ["10.0.0.0/8"]
    assert (node.registered_capacity or {}).get("memory_gb") == 16


def test_a_heartbeat_of_a_node_removed_meanwhile_is_a_404_and_brings_nothing_back(
    api: Any,
) -> None:
    from core.refusals import Refused
    from fleet.services import node_heartbeat

    token = add_node(api)
    beat(token)
    stale = Node.objects.get()
    api("staff").delete("/api/v1/nodes/n1")
    report = {"capacity": {"memory_gb": 8, "cores": 4, "gpus": 0, "gpu_memory_gb": 0}}
    with pytest.raises(Refused) as refused:
        node_heartbeat(node=stale, report=report, interval=2, peer="127.0.0.1")
    assert refused.value.status == 404 and not Node.objects.exists()


# -- the rules themselves ------------------------------------------------------------------------


def test_believed_takes_each_figure_up_to_the_registered_one() -> None:
    registered = trust.Capacity(memory_gb=8, cores=4, gpus=1, gpu_memory_gb=24)
    reported = trust.Capacity(memory_gb=4, cores=8, gpus=1, gpu_memory_gb=80)
    capacity, notes = trust.believed(reported, registered)
    assert capacity == trust.Capacity(memory_gb=4, cores=4, gpus=1, gpu_memory_gb=24)
    assert [note.split(",")[0] for note in notes] == [
        "reports 8 cores",
        "reports 80 GB per GPU",
    ]


def test_engine_address_reads_ipv4_mapped_peers_and_allow_lists() -> None:
    assert trust.engine_address(reported="", peer="::ffff:10.0.0.5", allowed=[], node="n") == (
        "10.0.0.5"
    )
    assert (
        trust.engine_address(reported="fd00::7", peer="10.0.0.5", allowed=["fd00::/64"], node="n")
        == "fd00::7"
    )
    with pytest.raises(trust.Untrusted) as refused:
        trust.engine_address(reported="0.0.0.0", peer="", allowed=[], node="n")
    assert refused.value.code == "address_unknown"
