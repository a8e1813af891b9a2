"""The catalog REST API: every endpoint, its refusals, and the audit entries it writes."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from catalog.models import AuditEntry, Model
from tests.factories import definition

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]

NO_CHECK = "/api/v1/models?source_check=false"


def add(client: Any, **overrides: Any) -> Any:
    return client.post(NO_CHECK, definition(**overrides), format="json")


def test_it_needs_a_token() -> None:
    from rest_framework.test import APIClient

    response = APIClient().get("/api/v1/models")
    assert response.status_code == 401
    assert response.json()["detail"].startswith("Log in first")


def test_a_bad_token_is_refused_with_a_hint() -> None:
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer nope")
    response = client.get("/api/v1/models")
    assert response.status_code == 401
    assert "Check LLMGW_TOKEN" in response.json()["detail"]


def test_bearer_tokens_work_too(tokens: dict[str, str]) -> None:
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {tokens['alice']}")
    assert client.get("/api/v1/models").status_code == 200


def test_adding_makes_you_the_owner_and_shows_what_is_in_force(api: Any) -> None:
    response = add(api("alice"), min_replicas=0, max_replicas=2)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["owner"] == "alice"
    assert body["kind"] == "runtime"
    assert body["class"] == "opportunistic"  # the default for an on-demand model
    assert body["scaling"] == {
        "min": 0,
        "max": 2,
        "max_follows_min": False,
        "on_demand": True,
        "parked": False,
        "idle_timeout": "15m",
    }
    entry = AuditEntry.objects.get(action="add")
    assert (entry.actor_name, entry.door, entry.model_name) == ("alice", "api", "tiny-chat")
    assert entry.after["profiles"][0]["memory_gb"] == 1


def test_it_adds_from_yaml_as_written(api: Any) -> None:
    text = yaml.safe_dump(definition(name="from-yaml"))
    response = api("alice").post(NO_CHECK, text, content_type="application/yaml")
    assert response.status_code == 201, response.json()
    assert Model.objects.filter(name="from-yaml").exists()


def test_malformed_yaml_is_refused_with_its_line(api: Any) -> None:
    text = "name: x\nsource: http://127.0.0.1:8000/x.gguf\nprofiles: [\n  - oops\n"
    response = api("alice").post(NO_CHECK, text, content_type="application/yaml")
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "parse_error"
    assert "not valid YAML" in body["detail"] and "line" in body["detail"]
    assert Model.objects.count() == 0


def test_field_problems_in_yaml_name_their_line(api: Any) -> None:
    text = "name: x\nsource: http://127.0.0.1:8000/x.gguf\nprofiles:\n  - name: cpu\n    memory_gb: -4\n"
    response = api("alice").post(NO_CHECK, text, content_type="application/yaml")
    assert response.status_code == 400
    assert response.json()["problems"] == [
        {"field": "profiles[0].memory_gb", "message": "must not be negative", "line": 5}
    ]


def test_a_huge_body_is_refused(api: Any) -> None:
    body = definition(description="x" * (2 * 1024 * 1024))
    response = api("alice").post(NO_CHECK, body, format="json")
    assert response.status_code == 413
    assert "too large" in response.json()["detail"]
    assert Model.objects.count() == 0


def test_a_taken_name_is_refused_naming_the_owner(api: Any) -> None:
    add(api("alice"))
    response = add(api("bob"))
    assert response.status_code == 409
    assert response.json()["detail"] == (
        "A model named tiny-chat already exists (added at runtime, owned by alice). "
        "Choose another name, or remove that one first."
    )


def test_an_adapter_name_may_not_shadow_a_model(api: Any) -> None:
    add(api("alice"), name="sql")
    adapter = {"name": "sql", "source": "http://127.0.0.1:8000/a.gguf"}
    response = add(api("bob"), name="base", adapters=[adapter])
    assert response.status_code == 400
    assert "'sql' is already the name of model sql" in response.json()["detail"]
    assert not Model.objects.filter(name="base").exists()


def test_fallbacks_must_exist(api: Any) -> None:
    response = add(api("alice"), fallbacks=["ghost"])
    assert response.status_code == 400
    assert "there is no model named 'ghost' to fall back to" in response.json()["detail"]


def test_only_the_owner_or_staff_may_change_a_model(api: Any) -> None:
    add(api("alice"))
    response = api("bob").post("/api/v1/models/tiny-chat/scale", {"min": 2}, format="json")
    assert response.status_code == 403
    assert response.json()["detail"].startswith(
        "tiny-chat belongs to alice; only they or a staff user may change it."
    )
    assert (
        api("staff").post("/api/v1/models/tiny-chat/scale", {"min": 2}, format="json").status_code
        == 200
    )
    assert Model.objects.get().min_replicas == 2


def test_unknown_models_get_404_with_close_names(api: Any) -> None:
    add(api("alice"))
    response = api("alice").post("/api/v1/models/tiny-caht/scale", {"min": 1}, format="json")
    assert response.status_code == 404
    assert (
        response.json()["detail"] == "There is no model named 'tiny-caht'; did you mean tiny-chat?"
    )


def test_scale_reports_what_is_in_force(api: Any) -> None:
    add(api("alice"), min_replicas=1, max_replicas=3)
    body = api("alice").post("/api/v1/models/tiny-chat/scale", {"min": 2}, format="json").json()
    # max left out follows min
    assert body["scaling"]["max"] == 2 and body["scaling"]["max_follows_min"] is True
    body = (
        api("alice")
        .post(
            "/api/v1/models/tiny-chat/scale",
            {"min": 0, "max": 4, "idle_timeout": "5m"},
            format="json",
        )
        .json()
    )
    assert body["scaling"]["on_demand"] is True and body["scaling"]["idle_timeout"] == "5m"
    assert body["class"] == "opportunistic"
    body = (
        api("alice")
        .post("/api/v1/models/tiny-chat/scale", {"min": 0, "max": 0}, format="json")
        .json()
    )
    assert body["scaling"]["parked"] is True
    entry = AuditEntry.objects.filter(action="scale").first()
    assert entry.changes == {"max_replicas": [4, 0]}


def test_scale_refuses_min_above_max(api: Any) -> None:
    add(api("alice"))
    response = api("alice").post(
        "/api/v1/models/tiny-chat/scale", {"min": 3, "max": 1}, format="json"
    )
    assert response.status_code == 400
    assert "max (1) is below min (3)" in response.json()["detail"]
    assert Model.objects.get().min_replicas == 1


@pytest.mark.parametrize(
    "body, message",
    [
        ({"min": -1}, "min: Ensure this value is greater than or equal to 0."),
        ({"min": "lots"}, "min: must be a whole number"),
        ({"min": "3"}, "min: must be a whole number"),
        ({}, "min: This field is required."),
        ({"min": 1, "idle_timeout": "later"}, "is not a duration"),
    ],
)
def test_scale_refuses_bad_input(api: Any, body: dict, message: str) -> None:
    add(api("alice"))
    response = api("alice").post("/api/v1/models/tiny-chat/scale", body, format="json")
    assert response.status_code == 400
    assert message in response.json()["detail"]


def test_resources_change_one_profile_or_all(api: Any) -> None:
    profiles = [
        {"name": "gpu", "memory_gb": 8, "gpus": 1, "gpu_memory_gb": 8},
        {"name": "cpu", "memory_gb": 4, "cores": 2},
    ]
    add(api("alice"), profiles=profiles)
    body = (
        api("alice")
        .post(
            "/api/v1/models/tiny-chat/resources", {"memory_gb": 6, "profile": "cpu"}, format="json"
        )
        .json()
    )
    assert [p["memory_gb"] for p in body["definition"]["profiles"]] == [8, 6]
    body = (
        api("alice")
        .post("/api/v1/models/tiny-chat/resources", {"memory_gb": 2.5, "cores": 3}, format="json")
        .json()
    )
    assert [(p["memory_gb"], p["cores"]) for p in body["definition"]["profiles"]] == [
        (2.5, 3),
        (2.5, 3),
    ]
    response = api("alice").post(
        "/api/v1/models/tiny-chat/resources", {"memory_gb": 2, "profile": "tpu"}, format="json"
    )
    assert response.status_code == 400
    assert "tiny-chat has no profile 'tpu'; it has gpu, cpu" in response.json()["detail"]


def test_class_can_be_set_and_reset_to_the_default(api: Any) -> None:
    add(api("alice"))
    body = (
        api("alice")
        .post("/api/v1/models/tiny-chat/class", {"class": "critical"}, format="json")
        .json()
    )
    assert (body["class"], body["class_set"]) == ("critical", "critical")
    body = (
        api("alice")
        .post("/api/v1/models/tiny-chat/class", {"class": "default"}, format="json")
        .json()
    )
    assert (body["class"], body["class_set"]) == ("standard", "default")
    response = api("alice").post("/api/v1/models/tiny-chat/class", {"class": "gold"}, format="json")
    assert response.status_code == 400 and "'gold' is not a class" in response.json()["detail"]


def test_owner_hands_a_model_over(api: Any) -> None:
    add(api("alice"))
    response = api("bob").post("/api/v1/models/tiny-chat/owner", {"owner": "bob"}, format="json")
    assert response.status_code == 403
    body = (
        api("alice").post("/api/v1/models/tiny-chat/owner", {"owner": "bob"}, format="json").json()
    )
    assert body["owner"] == "bob"
    assert (
        api("alice").post("/api/v1/models/tiny-chat/scale", {"min": 2}, format="json").status_code
        == 403
    )
    response = api("bob").post("/api/v1/models/tiny-chat/owner", {"owner": "nobody"}, format="json")
    assert (
        response.status_code == 400
        and "There is no user named 'nobody'" in response.json()["detail"]
    )
    entry = AuditEntry.objects.get(action="owner")
    assert entry.changes == {"owner": ["alice", "bob"]}


def test_only_staff_may_add_for_someone_else(api: Any) -> None:
    response = add(api("alice"), owner="bob")
    assert response.status_code == 403
    assert "only staff may add one owned by bob" in response.json()["detail"]
    assert add(api("staff"), owner="bob").json()["owner"] == "bob"


def test_adapters_are_added_removed_and_replaced(api: Any) -> None:
    add(api("alice"))
    url = "/api/v1/models/tiny-chat/adapters?source_check=false"
    sql = {"name": "tiny-sql", "source": "http://127.0.0.1:8000/sql.gguf", "scale": 0.8}
    body = api("alice").post(url, {"add": [sql]}, format="json").json()
    assert body == [{"name": "tiny-sql", "source": "http://127.0.0.1:8000/sql.gguf", "scale": 0.8}]
    response = api("alice").post(url, {"add": [sql]}, format="json")
    assert (
        response.status_code == 400
        and "already has an adapter 'tiny-sql'" in response.json()["detail"]
    )
    body = (
        api("alice")
        .post(url, {"remove": ["tiny-sql"], "add": [{**sql, "scale": 1}]}, format="json")
        .json()
    )
    assert body[0]["scale"] == 1
    body = api("alice").post(url, {"remove": ["tiny-sql"]}, format="json").json()
    assert body == []
    response = api("alice").post(url, {"remove": ["ghost"]}, format="json")
    assert (
        response.status_code == 400
        and "tiny-chat has no adapter 'ghost'" in response.json()["detail"]
    )
    assert api("alice").get("/api/v1/models/tiny-chat/adapters").json() == []
    assert AuditEntry.objects.filter(action="adapters").count() == 3


def test_removing_a_model_drops_it_from_every_fallback(api: Any) -> None:
    add(api("alice"), name="small")
    add(api("alice"), name="medium")
    add(api("alice"), name="big", fallbacks=["small", "medium"])
    add(api("alice"), name="other", fallbacks=["small"])
    assert api("alice").delete("/api/v1/models/small").status_code == 204
    assert Model.objects.get(name="big").fallbacks == ["medium"]
    assert Model.objects.get(name="other").fallbacks == []
    entries = AuditEntry.objects.filter(action="fallback-dropped").order_by("model_name")
    assert [(e.model_name, e.note, e.changes) for e in entries] == [
        (
            "big",
            "big no longer falls back to small: alice removed it",
            {"fallbacks": [["small", "medium"], ["medium"]]},
        ),
        (
            "other",
            "other no longer falls back to small: alice removed it",
            {"fallbacks": [["small"], None]},
        ),
    ]
    assert AuditEntry.objects.filter(action="remove").count() == 1


def test_audit_is_filtered_by_model_and_actor_and_paged(api: Any) -> None:
    add(api("alice"), name="a")
    add(api("bob"), name="b")
    for n in range(3):
        api("alice").post("/api/v1/models/a/scale", {"min": n + 2}, format="json")
    entries = api("carol").get("/api/v1/audit", {"model": "a"}).json()["entries"]
    assert [e["action"] for e in entries] == ["scale", "scale", "scale", "add"]
    assert [
        e["actor"] for e in api("carol").get("/api/v1/audit", {"actor": "bob"}).json()["entries"]
    ] == ["bob"]
    page = api("carol").get("/api/v1/audit", {"limit": 2}).json()
    assert len(page["entries"]) == 2 and page["next_before"] is not None
    rest = api("carol").get("/api/v1/audit", {"limit": 10, "before": page["next_before"]}).json()
    assert len(rest["entries"]) == 3 and rest["next_before"] is None


def test_the_openapi_schema_lists_every_endpoint(api: Any) -> None:
    response = api("alice").get("/api/v1/schema", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    paths = yaml.safe_load(response.content)["paths"]
    for path in [
        "/api/v1/models",
        "/api/v1/models/{name}",
        "/api/v1/models/{name}/scale",
        "/api/v1/models/{name}/resources",
        "/api/v1/models/{name}/class",
        "/api/v1/models/{name}/owner",
        "/api/v1/models/{name}/adapters",
        "/api/v1/audit",
    ]:
        assert path in paths, path
