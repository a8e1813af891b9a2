"""Every answer under /api/v1/ is JSON in the API's shape, typed inputs are refused when the type
is wrong, and answers carry exactly what their output serializers declare."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from tests.factories import definition

pytestmark = pytest.mark.django_db

NO_CHECK = "/api/v1/models?source_check=false"


def test_unknown_paths_under_the_api_answer_json(api: Any, users: dict[str, Any]) -> None:
    for client in (api("alice"), APIClient()):
        response = client.get("/api/v1/no-such-thing")
        assert response.status_code == 404
        assert response["Content-Type"] == "application/json"
        assert response.json()["code"] == "not_found"
        assert "/api/v1/docs" in response.json()["detail"]
    # A logged-in browser's POST gets the same answer, not a CSRF page.
    browser = APIClient(enforce_csrf_checks=True)
    browser.force_login(users["alice"])
    response = browser.post("/api/v1/keys/not-a-number/revoke")
    assert response.status_code == 404 and response.json()["code"] == "not_found"


def test_a_method_an_endpoint_does_not_take_is_405_in_json(api: Any) -> None:
    response = api("alice").put("/api/v1/models", {}, format="json")
    assert response.status_code == 405
    assert response.json()["code"] == "method_not_allowed"


def test_an_unexpected_error_is_500_in_json(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from catalog import api as catalog_api

    def broken() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(catalog_api, "current_config", broken)
    client = api("alice")
    client.raise_request_exception = False
    response = client.get("/api/v1/cluster")
    assert response.status_code == 500
    assert response["Content-Type"] == "application/json"
    assert response.json()["code"] == "server_error"


@pytest.mark.parametrize(
    "path, body, field, message",
    [
        ("scale", {"min": True}, "min", "must be a whole number"),
        ("scale", {"min": "2"}, "min", "must be a whole number"),
        ("scale", {"min": 1, "idle_timeout": 900}, "idle_timeout", "with its unit"),
        ("resources", {"memory_gb": 2, "cores": False}, "cores", "must be a number"),
        ("resources", {"memory_gb": "2"}, "memory_gb", "must be a number"),
        ("owner", {"owner": 5}, "owner", "must be text"),
        ("class", {"class": "gold"}, "class", "'gold' is not a class"),
        ("scale", {"min": 1, "mni": 2}, "mni", "unknown field; did you mean 'min'?"),
    ],
)
def test_inputs_of_the_wrong_type_are_refused(
    api: Any, path: str, body: dict[str, Any], field: str, message: str
) -> None:
    assert api("alice").post(NO_CHECK, definition(), format="json").status_code == 201
    response = api("alice").post(f"/api/v1/models/tiny-chat/{path}", body, format="json")
    assert response.status_code == 400, response.json()
    problems = response.json()["problems"]
    assert any(p["field"] == field and message in p["message"] for p in problems), problems


def test_a_definition_with_a_false_number_is_refused(api: Any) -> None:
    body = definition(profiles=[{"name": "cpu", "memory_gb": 1, "cores": False}])
    response = api("alice").post(NO_CHECK, body, format="json")
    assert response.status_code == 400
    assert response.json()["problems"] == [
        {"field": "profiles[0].cores", "message": "must be a number"}
    ]


def test_answers_carry_what_their_serializers_declare(api: Any) -> None:
    from catalog.api import ModelOut
    from fleet.api import NodeOut

    model = api("alice").post(NO_CHECK, definition(), format="json").json()
    declared = set(ModelOut().fields) - {"source_size_text"}  # only when the size is known
    assert set(model) == declared
    assert set(api("alice").get("/api/v1/models/tiny-chat").json()) == declared
    api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json")
    nodes = api("alice").get("/api/v1/nodes").json()
    assert isinstance(nodes, list) and set(nodes[0]) == set(NodeOut().fields)


def test_the_schema_documents_every_refusal_and_the_token(api: Any) -> None:
    import yaml

    schema = yaml.safe_load(api("alice").get("/api/v1/schema").content)
    schemes = schema["components"]["securitySchemes"]
    assert set(schemes) == {"apiToken", "nodeToken"}
    scale = schema["paths"]["/api/v1/models/{name}/scale"]["post"]
    assert {"200", "400", "401", "403", "404", "409", "413", "415"} <= set(scale["responses"])
    request = scale["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert (
        schema["components"]["schemas"][request.rsplit("/", 1)[1]]["additionalProperties"] is False
    )
    nodes = schema["paths"]["/api/v1/nodes"]["get"]["responses"]["200"]
    assert nodes["content"]["application/json"]["schema"]["type"] == "array"


def test_usage_is_filtered_by_key(api: Any) -> None:
    key = api("alice").post("/api/v1/keys", {"name": "app"}, format="json").json()
    response = api("alice").get(f"/api/v1/usage?key={key['id']}&format=csv")
    assert response.status_code == 200
    assert response.content.decode().splitlines()[0].startswith("day,key,")
    assert api("alice").get("/api/v1/usage?key=99999999999999999999").status_code == 400
    assert api("alice").get("/api/v1/usage?since=").status_code == 400
    unknown = api("alice").get("/api/v1/usage?format=xml")
    assert unknown.status_code == 400 and unknown.json()["code"] == "invalid"
