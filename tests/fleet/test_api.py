"""The fleet API: nodes for staff, the node-facing heartbeat and its tokens, restart, demand, target, plan."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from fleet.models import Node, Replica
from fleet.reconciler import reconcile_pass

pytestmark = pytest.mark.django_db

BEAT = {"capacity": {"memory_gb": 8, "cores": 4}, "replicas": []}


def node_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def test_staff_add_nodes_and_get_a_token_once(api: Any) -> None:
    response = api("staff").post("/api/v1/nodes", {"name": "gpu-1"}, format="json")
    assert response.status_code == 201
    token = response.json()["token"]
    assert token.startswith("llmgw-node-")
    assert token not in str(Node.objects.values_list())  # only its hash is kept
    listed = api("bob").get("/api/v1/nodes").json()
    assert listed[0]["name"] == "gpu-1" and listed[0]["state"] == "waiting for its agent"
    assert "token" not in listed[0]


def test_only_staff_manage_nodes(api: Any) -> None:
    response = api("alice").post("/api/v1/nodes", {"name": "n"}, format="json")
    assert response.status_code == 403
    assert response.json()["detail"] == "Only staff may add nodes; ask an administrator."


def test_node_names_are_checked_and_unique(api: Any) -> None:
    assert (
        "is not a node name"
        in api("staff").post("/api/v1/nodes", {"name": "bad name"}, format="json").json()["detail"]
    )
    api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json")
    response = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json")
    assert response.status_code == 409


def test_a_heartbeat_reports_capacity_and_gets_what_to_run(api: Any) -> None:
    token = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json").json()["token"]
    response = node_client(token).post("/api/v1/node/heartbeat", BEAT, format="json")
    assert response.status_code == 200
    assert response.json() == {
        "node": "n1",
        "heartbeat_interval": 2,
        "generation": 0,
        "replicas": [],
        "keep": [],
        "warnings": [],
    }
    view = api("alice").get("/api/v1/nodes").json()[0]
    assert (
        view["state"] == "ready"
        and view["capacity"]["memory_gb"] == 8
        and view["free"]["cores"] == 4
    )


def test_an_unknown_node_token_gets_401(api: Any) -> None:
    response = node_client("llmgw-node-nope").post("/api/v1/node/heartbeat", BEAT, format="json")
    assert response.status_code == 401
    assert response.json()["detail"].startswith("This is not a node token the control plane knows.")


def test_user_tokens_cannot_pose_as_nodes_and_node_tokens_cannot_use_the_admin_api(
    api: Any, tokens: dict[str, str]
) -> None:
    response = node_client(tokens["staff"]).post("/api/v1/node/heartbeat", BEAT, format="json")
    assert response.status_code == 401
    token = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json").json()["token"]
    assert node_client(token).get("/api/v1/models").status_code == 401
    assert (
        node_client(token).post("/api/v1/nodes", {"name": "evil"}, format="json").status_code == 401
    )


@pytest.mark.parametrize(
    "body, message",
    [
        ({"replicas": []}, "capacity: This field is required."),
        ({"capacity": {"memory_gb": -1, "cores": 1}}, "capacity.memory_gb"),
        (
            {"capacity": {"memory_gb": 1, "cores": 1}, "replicas": [{"id": "x", "state": "ready"}]},
            "replicas[0].id: Must be a valid UUID.",
        ),
        (
            {
                "capacity": {"memory_gb": 1, "cores": 1},
                "replicas": [{"id": "6c1f9f6e-3a4e-4a7b-9f7e-0e7e2a5f0b11", "state": "dancing"}],
            },
            "is not a valid choice",
        ),
        ("garbage", "Invalid data"),
    ],
)
def test_a_garbage_heartbeat_gets_400_and_changes_nothing(
    api: Any, body: Any, message: str
) -> None:
    token = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json").json()["token"]
    response = node_client(token).post("/api/v1/node/heartbeat", body, format="json")
    assert response.status_code == 400
    assert message in response.json()["detail"]
    assert Node.objects.get().last_heartbeat is None


def test_cordon_uncordon_and_remove(api: Any) -> None:
    api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json")
    assert api("staff").post("/api/v1/nodes/n1/cordon").json()["cordoned"] is True
    assert api("staff").post("/api/v1/nodes/n1/uncordon").json()["cordoned"] is False
    assert api("alice").delete("/api/v1/nodes/n1").status_code == 403
    assert api("staff").delete("/api/v1/nodes/n1").status_code == 204
    response = api("staff").delete("/api/v1/nodes/n1")
    assert (
        response.status_code == 404 and "There is no node named 'n1'" in response.json()["detail"]
    )


def _node_with_capacity(api: Any, name: str, memory_gb: float) -> str:
    token = api("staff").post("/api/v1/nodes", {"name": name}, format="json").json()["token"]
    node_client(token).post(
        "/api/v1/node/heartbeat", {"capacity": {"memory_gb": memory_gb, "cores": 8}}, format="json"
    )
    return token


def _add(api: Any, user: str, **definition: Any) -> None:
    from tests.factories import definition as make

    response = api(user).post(
        "/api/v1/models?source_check=false", make(**definition), format="json"
    )
    assert response.status_code == 201, response.json()


def test_target_says_where_and_why_not(api: Any) -> None:
    _node_with_capacity(api, "node-a", 4)
    _node_with_capacity(api, "node-b", 12)
    _add(api, "alice", name="big", min_replicas=2, profiles=[{"name": "cpu", "memory_gb": 24}])
    reconcile_pass()
    target = api("bob").get("/api/v1/models/big/target").json()
    assert target["desired"] == 2 and target["ready"] == 0 and target["why"] == "min_replicas is 2"
    assert target["unplaced"][0]["count"] == 2
    assert "24 GB" in target["unplaced"][0]["reason"] and "12 GB" in target["unplaced"][0]["reason"]
    assert "node-b" in target["unplaced"][0]["reason"]


def test_plan_shows_placements_and_preemptions_without_changing_anything(api: Any) -> None:
    _node_with_capacity(api, "node-a", 2)
    _add(
        api,
        "alice",
        name="filler",
        min_replicas=2,
        profiles=[{"name": "cpu", "memory_gb": 1}],
        **{"class": "opportunistic"},
    )
    reconcile_pass()
    from tests.factories import definition as make

    body = make(name="vip", profiles=[{"name": "cpu", "memory_gb": 1}], **{"class": "critical"})
    plan = api("bob").post("/api/v1/plan", body, format="json").json()
    assert plan["placements"] == [
        {"node": "node-a", "profile": "cpu", "devices": [], "gpu_memory_gb_per_device": 0}
    ]
    assert [p["model"] for p in plan["preemptions"]] == ["filler"]
    assert Replica.objects.filter(withdrawn_at__isnull=True).count() == 2
    from catalog.models import Model

    assert not Model.objects.filter(name="vip").exists()
    assert api("bob").get("/api/v1/models/filler/plan").json()["placements"][0]["node"] == "node-a"


def test_plan_wants_what_the_reconciler_wants_of_an_on_demand_model(api: Any) -> None:
    """The plan's wanted count is the model's desired count, the one the reconciler and the
    model's answer use: none for an on-demand model nobody asked for, one once asked for."""
    _node_with_capacity(api, "node-a", 8)
    _add(api, "alice", name="lazy", min_replicas=0, max_replicas=2)
    idle = api("bob").get("/api/v1/models/lazy/plan").json()
    assert (idle["desired"], idle["placements"]) == (0, [])
    assert idle["desired"] == api("bob").get("/api/v1/models/lazy").json()["desired"]

    api("alice").post("/api/v1/models/lazy/demand")
    asked = api("bob").get("/api/v1/models/lazy/plan").json()
    cpu_placement = {
        "node": "node-a",
        "profile": "cpu",
        "devices": [],
        "gpu_memory_gb_per_device": 0,
    }
    assert (asked["desired"], asked["placements"]) == (1, [cpu_placement])

    from tests.factories import definition as make

    body = make(name="new-lazy", min_replicas=0, max_replicas=1)
    fresh = api("bob").post("/api/v1/plan", body, format="json").json()
    assert (fresh["desired"], fresh["placements"]) == (0, [])


def test_restart_bumps_the_generation_and_is_audited(api: Any) -> None:
    _add(api, "alice", name="chat")
    assert api("bob").post("/api/v1/models/chat/restart").status_code == 403
    assert api("alice").post("/api/v1/models/chat/restart").json() == {
        "model": "chat",
        "generation": 1,
    }
    entry = api("alice").get("/api/v1/audit", {"action": "restart"}).json()["entries"][0]
    assert entry["changes"] == {"generation": [0, 1]}


def test_demand_by_the_owner_loads_an_on_demand_model(api: Any) -> None:
    # Others make it load by using it through the gateway (tests/catalog/test_rights.py).
    _node_with_capacity(api, "node-a", 8)
    _add(api, "alice", name="lazy", min_replicas=0, max_replicas=2)
    assert api("bob").get("/api/v1/models/lazy").json()["desired"] == 0
    body = api("alice").post("/api/v1/models/lazy/demand").json()
    assert body["on_demand"] is True
    assert api("bob").get("/api/v1/models/lazy").json()["desired"] == 1
    assert api("bob").post("/api/v1/models/ghost/demand").status_code == 404


def test_plan_estimates_memory_from_the_gguf_header_and_warns(
    api: Any, tmp_path: Any, settings: Any
) -> None:
    from urllib.parse import urlsplit

    from llmgw.tinygguf import write_tiny_model
    from tests.factories import definition as make
    from tests.support.http_files import serve_directory

    write_tiny_model(tmp_path / "tiny.gguf", seed=1, context_length=2048)
    with serve_directory(tmp_path) as (base_url, _stats):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(base_url).netloc]
        body = make(
            name="est",
            source=f"{base_url}/tiny.gguf",
            context_length=1024,
            profiles=[{"name": "tight", "memory_gb": 0.0001}, {"name": "roomy", "memory_gb": 1}],
        )
        plan = api("bob").post("/api/v1/plan", body, format="json").json()
    size = (tmp_path / "tiny.gguf").stat().st_size
    estimate = plan["estimate"]
    assert estimate["context_length"] == 1024
    assert abs(estimate["weights_gb"] - size / 1024**3) < 0.001
    # 2 layers x 1024 tokens x 2 KV heads x 16 dims x 2 (K and V) x 2 bytes
    assert abs(estimate["kv_cache_gb"] * 1024**3 - 2 * 1024 * 2 * 16 * 2 * 2) < 1024**3 * 0.001
    [warning] = plan["warnings"]
    assert warning.startswith("profile tight declares 0.0001 GB, below the estimated")


def test_a_replicas_slots_come_from_its_profile_and_reach_its_node(api: Any, fleet: Any) -> None:
    token = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json").json()["token"]
    node_client(token).post("/api/v1/node/heartbeat", BEAT, format="json")
    fleet.add("chat", profiles=[{"name": "cpu", "memory_gb": 1, "cores": 1, "slots": 4}])
    fleet.add("solo")
    reconcile_pass()

    answer = node_client(token).post("/api/v1/node/heartbeat", BEAT, format="json").json()

    assert {r["model"]: r["slots"] for r in answer["replicas"]} == {"chat": 4, "solo": 1}
    assert {r.model_name: r.slots for r in Replica.objects.all()} == {"chat": 4, "solo": 1}


def test_a_heartbeat_keeps_each_replicas_engine_numbers(api: Any, fleet: Any) -> None:
    token = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json").json()["token"]
    node_client(token).post("/api/v1/node/heartbeat", BEAT, format="json")
    fleet.add("chat", profiles=[{"name": "cpu", "memory_gb": 1, "cores": 1, "slots": 4}])
    reconcile_pass()
    replica = Replica.objects.get()
    numbers = {
        "predicted_tokens": 640.0,
        "prompt_tokens": 300.0,
        "prompt_tokens_cached": 100.0,
        "requests_processing": 3.0,
        "requests_deferred": 1.0,
        "tokens_per_second": 42.5,
        "slots": 4.0,
    }
    report = {"id": str(replica.pk), "state": "ready", "port": 41000, "engine": numbers}

    beat = {**BEAT, "replicas": [report]}
    assert node_client(token).post("/api/v1/node/heartbeat", beat, format="json").status_code == 200

    replica.refresh_from_db()
    assert replica.engine_metrics == numbers and replica.engine_metrics_at is not None
    shown = api("alice").get("/api/v1/models/chat/target").json()["replicas"][0]
    assert shown["slots"] == 4
    assert shown["engine"] == {
        "tokens_per_second": 42.5,
        "busy_slots": 3,
        "slots": 4,
        "waiting": 1,
        "predicted_tokens": 640,
        "prompt_tokens": 400,
        "prompt_tokens_cached": 100,
        "prompt_cache_hit_ratio": 0.25,
        "reported_at": replica.engine_metrics_at.isoformat(),
    }
    junk = {**report, "engine": {"x" * 65: 1.0}}
    response = node_client(token).post(
        "/api/v1/node/heartbeat", {**BEAT, "replicas": [junk]}, format="json"
    )
    assert response.status_code == 400


def test_a_heartbeat_asks_to_keep_the_previous_revisions_of_its_models(
    api: Any, fleet: Any
) -> None:
    token = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json").json()["token"]
    node_client(token).post("/api/v1/node/heartbeat", BEAT, format="json")
    model = fleet.add("chat")
    fleet.add("other")
    old = "http://127.0.0.1:8000/mirror/acme/chat/0000aaa/chat.gguf"
    model.previous = {"source": old, "sha256": "a" * 64}
    model.save(update_fields=["previous"])
    reconcile_pass()

    answer = node_client(token).post("/api/v1/node/heartbeat", BEAT, format="json").json()

    assert answer["keep"] == [{"source": old, "sha256": "a" * 64}]


def test_the_keep_list_names_each_models_previous_revision_once_in_name_order_in_one_read(
    api: Any, fleet: Any
) -> None:
    token = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json").json()["token"]
    big = {**BEAT, "capacity": {"memory_gb": 64, "cores": 32}}
    node_client(token).post("/api/v1/node/heartbeat", big, format="json")
    for name in ("zeta", "alpha", "plain"):
        model = fleet.add(name, min_replicas=2, max_replicas=2)
        if name != "plain":
            model.previous = {"source": f"http://127.0.0.1:8000/mirror/acme/{name}/old.gguf"}
            model.save(update_fields=["previous"])
    reconcile_pass()
    assert Replica.objects.filter(node__name="n1", withdrawn_at__isnull=True).count() == 6

    with CaptureQueriesContext(connection) as queries:
        answer = node_client(token).post("/api/v1/node/heartbeat", big, format="json").json()

    assert answer["keep"] == [
        {"source": "http://127.0.0.1:8000/mirror/acme/alpha/old.gguf", "sha256": None},
        {"source": "http://127.0.0.1:8000/mirror/acme/zeta/old.gguf", "sha256": None},
    ]
    assert len(answer["replicas"]) == 6
    # The replicas and their models' previous revisions come in one read, not two.
    reads = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT")]
    assert not [sql for sql in reads if sql.lstrip().startswith('SELECT "catalog_model"')], reads


def test_a_report_of_replicas_turning_ready_writes_them_in_one_update(api: Any, fleet: Any) -> None:
    """The replicas a report changes are written with one UPDATE from a VALUES list on
    PostgreSQL (one UPDATE each elsewhere), never bulk_update's CASE WHEN a row and a field:
    building that was 60 % of a report's CPU in the web when four replicas turned ready, the
    report every node of a large placement sends, and Django's UPDATE a replica a third."""
    token = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json").json()["token"]
    big = {**BEAT, "capacity": {"memory_gb": 64, "cores": 32}}
    node_client(token).post("/api/v1/node/heartbeat", big, format="json")
    fleet.add("m", min_replicas=4, max_replicas=4)
    reconcile_pass()
    ids = sorted(str(pk) for pk in Replica.objects.values_list("pk", flat=True))
    states = ("ready", "starting", "ready", "fetching")
    report = {
        **big,
        "replicas": [
            {
                "id": pk,
                "state": states[i],
                "port": 41000 + i,
                "message": f"replica {i}",
                "engine": {"tokens_per_second": 2.0 + i},
            }
            for i, pk in enumerate(ids)
        ],
    }

    with CaptureQueriesContext(connection) as queries:
        answer = node_client(token).post("/api/v1/node/heartbeat", report, format="json")

    assert answer.status_code == 200
    written = {str(r.pk): r for r in Replica.objects.all()}
    assert {
        pk: (
            written[pk].state,
            written[pk].port,
            written[pk].message,
            written[pk].engine_metrics,
            written[pk].ready_at is not None,
        )
        for pk in ids
    } == {
        pk: (state, 41000 + i, f"replica {i}", {"tokens_per_second": 2.0 + i}, state == "ready")
        for i, (pk, state) in enumerate(zip(ids, states, strict=True))
    }
    assert all(written[pk].engine_metrics_at and written[pk].state_changed_at for pk in ids)
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    replica_updates = [sql for sql in updates if sql.startswith('UPDATE "fleet_replica"')]
    assert len(replica_updates) == (1 if connection.vendor == "postgresql" else 4), updates
    assert not [sql for sql in updates if "CASE WHEN" in sql], updates
