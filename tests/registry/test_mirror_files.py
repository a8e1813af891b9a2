"""The mirror serves its files with Range support, to nodes and people who log in only, and
nothing outside its root."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.django_db


@pytest.fixture
def mirror(tmp_path: Path, server_yaml: Any) -> Path:
    root = tmp_path / "mirror"
    (root / "acme" / "tiny" / "abc123").mkdir(parents=True)
    (root / "acme" / "tiny" / "abc123" / "w.gguf").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "secret.txt").write_text("no")
    server_yaml({"mirror": {"root": str(root)}})
    return root


@pytest.fixture
def client(users: dict[str, Any]) -> Any:
    """A node's client: it sends its node token, as the agent does."""
    from django.test import Client

    from core.actor import Actor
    from fleet.services import node_add

    _, token = node_add(actor=Actor.for_user(users["staff"], "api"), name="n1")
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def test_it_serves_whole_files_and_ranges(client: Any, mirror: Path) -> None:
    whole = client.get("/mirror/acme/tiny/abc123/w.gguf")
    assert whole.status_code == 200 and whole["Content-Length"] == "1024"
    assert b"".join(whole.streaming_content) == bytes(range(256)) * 4
    part = client.get("/mirror/acme/tiny/abc123/w.gguf", HTTP_RANGE="bytes=10-19")
    assert part.status_code == 206 and part["Content-Range"] == "bytes 10-19/1024"
    assert b"".join(part.streaming_content) == bytes(range(10, 20))
    tail = client.get("/mirror/acme/tiny/abc123/w.gguf", HTTP_RANGE="bytes=-4")
    assert b"".join(tail.streaming_content) == bytes([252, 253, 254, 255])
    head = client.head("/mirror/acme/tiny/abc123/w.gguf")
    assert (
        head.status_code == 200
        and head["Content-Length"] == "1024"
        and head["Accept-Ranges"] == "bytes"
    )
    assert (
        client.get("/mirror/acme/tiny/abc123/w.gguf", HTTP_RANGE="bytes=5000-").status_code == 416
    )


def test_it_refuses_paths_outside_its_root_and_missing_files(client: Any, mirror: Path) -> None:
    assert client.get("/mirror/../secret.txt").status_code == 404
    assert (
        client.get("/mirror/acme/tiny/abc123/%2e%2e/%2e%2e/%2e%2e/../secret.txt").status_code == 404
    )
    assert client.get("/mirror/acme/tiny/abc123/nope.gguf").status_code == 404
    assert client.post("/mirror/acme/tiny/abc123/w.gguf").status_code == 405


def test_it_refuses_anonymous_readers_before_saying_whether_a_file_exists(mirror: Path) -> None:
    from django.test import Client

    for path in ("acme/tiny/abc123/w.gguf", "acme/tiny/abc123/nope.gguf"):
        for send in (Client().get, Client().head):
            response = send(f"/mirror/{path}")
            assert response.status_code == 401, path
            assert response["WWW-Authenticate"].startswith("Bearer")
    refusal = Client().get("/mirror/acme/tiny/abc123/w.gguf")
    assert b"send a node token or an API token" in refusal.content
    wrong = Client(HTTP_AUTHORIZATION="Bearer llmgw-node-not-a-token")
    assert wrong.get("/mirror/acme/tiny/abc123/w.gguf").status_code == 401


def test_it_serves_people_with_a_token_or_a_session(
    mirror: Path, users: dict[str, Any], tokens: dict[str, str]
) -> None:
    from django.test import Client

    by_token = Client(HTTP_AUTHORIZATION=f"Token {tokens['bob']}")
    assert by_token.get("/mirror/acme/tiny/abc123/w.gguf").status_code == 200
    by_session = Client()
    by_session.force_login(users["carol"])
    assert by_session.head("/mirror/acme/tiny/abc123/w.gguf").status_code == 200
    users["bob"].is_active = False
    users["bob"].save()
    assert by_token.get("/mirror/acme/tiny/abc123/w.gguf").status_code == 401


def test_it_answers_nul_bytes_and_absurd_ranges_with_a_4xx(client: Any, mirror: Path) -> None:
    assert client.get("/mirror/acme/tiny/abc123/w%00.gguf").status_code == 404
    assert client.get("/mirror/acme/%00/abc123/w.gguf").status_code == 404
    assert client.get("/mirror/" + "a" * 5000 + "/w.gguf").status_code == 404
    for absurd in (
        "bytes=" + "9" * 5000 + "-",
        "bytes=0-" + "9" * 5000,
        "bytes=-" + "9" * 5000,
        "bytes=99999999999999999999-",
        "bytes=-0",
    ):
        response = client.get("/mirror/acme/tiny/abc123/w.gguf", HTTP_RANGE=absurd)
        assert response.status_code == 416, absurd
        assert response["Content-Range"] == "bytes */1024"
    # A range the file cannot hold the end of is cut at the end of the file.
    part = client.get("/mirror/acme/tiny/abc123/w.gguf", HTTP_RANGE="bytes=1000-99999999999")
    assert part.status_code == 206 and part["Content-Range"] == "bytes 1000-1023/1024"


@pytest.mark.django_db(transaction=True)
def test_the_control_plane_checks_sources_in_its_own_mirror(
    live_server: Any, mirror: Path, settings: Any, api: Any
) -> None:
    from urllib.parse import urlsplit

    from llmgw.tinygguf import write_lora_adapter, write_tiny_model
    from tests.factories import definition

    write_tiny_model(mirror / "acme" / "tiny" / "abc123" / "tiny.gguf", seed=1)
    write_lora_adapter(mirror / "acme" / "tiny" / "abc123" / "sql.gguf", seed=2)
    settings.LLMGW_PUBLIC_URL = live_server.url
    settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(live_server.url).netloc]
    base = f"{live_server.url}/mirror/acme/tiny/abc123"
    body = definition(
        source=f"{base}/tiny.gguf", adapters=[{"name": "sql", "source": f"{base}/sql.gguf"}]
    )
    response = api("alice").post("/api/v1/models", body, format="json")
    assert response.status_code == 201, response.json()
    plan = api("alice").get("/api/v1/models/tiny-chat/plan").json()
    assert plan["estimate"] is not None, plan["warnings"]
