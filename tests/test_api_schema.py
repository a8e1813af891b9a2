"""The API's schema tells the truth: schemathesis runs every operation of /api/v1/ against a live
server, with every check on, and finds nothing (no 5xx, no answer outside the schema, no
undocumented status, no wrong input accepted).

The operations are split into parts (PARTS), each run by a test of its own on a server and a
database of its own, so that the suite's processes run them side by side; a test checks that
every operation of the schema is in exactly one part.

tests/schemathesis.toml holds its settings; the README names the one it relaxes and why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.registry import LocalRegistry, available

CONFIG = Path(__file__).parent / "schemathesis.toml"

# The operations, by path, in parts of 8-12 operations each.
PARTS = {
    "one-model-a": r"^/api/v1/models/\{name\}/(adapters|autoscale|canary|class|demand|owner|plan)",
    "one-model-b": r"^/api/v1/models/\{name\}/(resources|restart|rollback|rollout|scale|target|traffic|update)",
    "catalog": r"^/api/v1/(models(/\{name\})?|plan|serve|updates(/check)?|fetches/\{id\}|canaries)$",
    "fleet": r"^/api/v1/(nodes|node|cluster)(/|$)",
    "people": r"^/api/v1/(keys|teams|usage|audit|tokens|login)(/|$)",
}


@pytest.mark.django_db
def test_the_parts_hold_every_operation_once(api: Any) -> None:
    import yaml

    schema = yaml.safe_load(api("alice").get("/api/v1/schema").content)
    assert len(schema["paths"]) > 30
    for path in schema["paths"]:
        parts = [name for name, pattern in PARTS.items() if re.search(pattern, path)]
        assert len(parts) == 1, f"{path} is in {parts or 'no part'}: add it to one of PARTS"


@pytest.mark.skipif(available() is not None, reason=str(available()))
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("part", PARTS)
def test_schemathesis_finds_nothing(
    live_server: Any,
    tokens: dict[str, str],
    users: dict[str, Any],
    server_yaml: Any,
    tmp_path: Path,
    part: str,
) -> None:
    from catalog.definitions import clean_definition
    from catalog.services import model_add
    from core.actor import Actor
    from fleet.services import node_add

    with LocalRegistry(tmp_path / "registry") as registry:
        registry.commit("acme/tiny", {"tiny.gguf": b"GGUF" + bytes(60)})
        server_yaml(
            {
                "registry": {"endpoint": registry.endpoint},
                "mirror": {"root": str(tmp_path / "mirror")},
            }
        )
        staff = Actor.for_user(users["staff"], "api")
        _, node_token = node_add(actor=staff, name="node-1")
        # The model tests/schemathesis.toml names for the operations on one model.
        parked = {"name": "schema-chat", "min_replicas": 0, "max_replicas": 0}
        source = f"{live_server.url}/mirror/acme/schema-chat/abc123/w.gguf"
        model_add(
            actor=staff,
            definition=clean_definition(
                {**parked, "source": source, "profiles": [{"name": "cpu", "memory_gb": 1}]}
            ),
            source_check=False,
        )
        env = {
            **os.environ,
            "LLMGW_TEST_TOKEN": tokens["staff"],
            "LLMGW_TEST_NODE_TOKEN": node_token,
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "--config-file",
                str(CONFIG),
                "run",
                f"{live_server.url}/api/v1/schema",
                "--include-path-regex",
                PARTS[part],
                "--checks",
                "all",
                "--seed",
                "20261202",
                "--workers",
                "1",
                "--no-color",
                "--generation-database",
                "none",
                "--report-dir",
                str(tmp_path / "report"),
            ],
            env=env,
            cwd=tmp_path,  # its caches stay out of the checkout
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert result.returncode == 0, result.stdout[-30000:] + result.stderr[-5000:]


# Text a request may leave empty on purpose: a node reports no address while it has none, a
# replica's message and digest may be empty, a description is optional prose.
MAY_BE_EMPTY = {
    ("HeartbeatInputRequest", "address"),
    ("ReplicaReportInputRequest", "message"),
    ("ReplicaReportInputRequest", "sha256"),
    ("ModelDefinitionRequest", "description"),
    # A GPU's uuid and name are empty where the driver does not say them (--gpus given).
    ("DeviceInputRequest", "uuid"),
    ("DeviceInputRequest", "name"),
}


@pytest.mark.django_db
def test_every_name_a_request_sends_is_at_least_one_character(api: Any) -> None:
    import yaml

    schema = yaml.safe_load(api("alice").get("/api/v1/schema").content)
    texts = {}
    for component, body in schema["components"]["schemas"].items():
        for field, property in body.get("properties", {}).items():
            if property.get("type") == "array":
                property = property.get("items", {})
            if property.get("type") == "string" and "enum" not in property:
                texts[component, field] = property
    assert ("ModelDefinitionRequest", "name") in texts
    open_ended = [
        where
        for where, property in texts.items()
        if where[0].endswith("Request")
        and where not in MAY_BE_EMPTY
        and property.get("format") != "uuid"
        and property.get("minLength", 0) < 1
    ]
    assert open_ended == []
    # Answers keep their own components: a text an answer may leave empty is not promised.
    assert "minLength" not in texts["KeyOut", "name"]


EMPTY_NAMES = [
    (
        "/api/v1/keys",
        {"name": ""},
        "name",
        "give the key a name that says what it is for, say the application using it",
    ),
    (
        "/api/v1/nodes",
        {"name": ""},
        "name",
        "give the node a name, like gpu-1: letters, digits, '.', '_', '-' and ':'",
    ),
    (
        "/api/v1/models/schema-chat/owner",
        {"owner": ""},
        "owner",
        "give the username of the new owner",
    ),
    (
        "/api/v1/models/schema-chat/resources",
        {"memory_gb": 1, "profile": ""},
        "profile",
        "name one of the model's profiles, or leave profile out for every profile",
    ),
    (
        "/api/v1/models/schema-chat/adapters",
        {"remove": [""]},
        "remove[0]",
        "give the name of the adapter to remove",
    ),
    ("/api/v1/models", {"name": "", "source": "http://mirror.example/w.gguf"}, "name", None),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("path", "body", "field", "message"), EMPTY_NAMES)
def test_an_empty_name_is_refused_saying_what_to_send(
    api: Any, path: str, body: dict[str, Any], field: str, message: str | None
) -> None:
    from catalog.models import AuditEntry

    response = api("staff").post(path, body, format="json")
    assert response.status_code == 400, response.content
    problems = {p["field"]: p["message"] for p in response.json()["problems"]}
    assert field in problems
    if message is not None:
        assert problems[field] == message
    assert not AuditEntry.objects.exists()  # nothing was changed


@pytest.mark.django_db
@pytest.mark.parametrize(
    "repo",
    ["acme/" + "x" * 97, "acme/-tiny", "acme/tiny.", "acme/ti--ny", "acme/ti..ny", "a/b.git"],
)
def test_a_repository_the_registry_client_refuses_is_the_askers_mistake(
    api: Any, repo: str, server_yaml: Any
) -> None:
    # Found by schemathesis: huggingface_hub refuses these ids before asking the registry, and
    # that refusal was answered as the registry's failure, 502.
    from registry.models import Fetch

    server_yaml({"registry": {"endpoint": "http://127.0.0.1:9"}})  # never asked
    response = api("staff").post("/api/v1/serve", {"repo": repo}, format="json")
    assert response.status_code == 400, response.content
    [problem] = response.json()["problems"]
    assert problem["field"] == "repo"
    assert "like Qwen/Qwen2.5-0.5B-Instruct-GGUF" in problem["message"]
    assert not Fetch.objects.exists()
