"""Source and adapter checks against a real HTTP server on 127.0.0.1 serving generated GGUF files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from catalog.models import Model
from llmgw.tinygguf import write_lora_adapter, write_tiny_model
from tests.factories import definition
from tests.support.http_files import serve_directory

pytestmark = pytest.mark.django_db


@pytest.fixture
def files(tmp_path: Path, settings: Any) -> Iterator[str]:
    """A file server holding a tiny model, an adapter for it, and one for another architecture."""
    write_tiny_model(tmp_path / "tiny.gguf", seed=1)
    write_lora_adapter(tmp_path / "sql.gguf", seed=2)
    write_lora_adapter(tmp_path / "qwen-sql.gguf", architecture="qwen2", seed=3)
    with serve_directory(tmp_path) as (base_url, _stats):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(base_url).netloc]
        yield base_url


def add(client: Any, **overrides: Any) -> Any:
    return client.post("/api/v1/models", definition(**overrides), format="json")


def test_a_source_that_is_there_is_added_with_its_size(
    api: Any, files: str, tmp_path: Path
) -> None:
    response = add(api("alice"), source=f"{files}/tiny.gguf")
    assert response.status_code == 201, response.json()
    size = (tmp_path / "tiny.gguf").stat().st_size
    assert response.json()["source_size"] == size
    assert Model.objects.get().source_size == size


def test_a_missing_source_is_refused_with_the_url_and_status(api: Any, files: str) -> None:
    response = add(api("alice"), source=f"{files}/nope.gguf")
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "source_missing"
    assert body["detail"].startswith(f"The source {files}/nope.gguf is not there: it answered 404")
    assert "Pass --no-source-check" in body["detail"]
    assert Model.objects.count() == 0


def test_an_unreachable_source_is_refused(api: Any, settings: Any) -> None:
    settings.LLMGW_SOURCE_ALLOWED_HOSTS = ["127.0.0.1:9"]
    response = add(api("alice"), source="http://127.0.0.1:9/x.gguf")
    assert response.status_code == 400
    assert "could not be reached: nothing answered there" in response.json()["detail"]


def test_a_host_that_is_not_allowed_is_never_asked(api: Any, files: str, settings: Any) -> None:
    settings.LLMGW_SOURCE_ALLOWED_HOSTS = ["mirror.internal:8000"]
    response = add(api("alice"), source=f"{files}/tiny.gguf")
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "source_host_not_allowed"
    assert (
        "not in sources.allowed_hosts in server.yaml (nor LLMGW_SOURCE_ALLOWED_HOSTS)"
        in body["detail"]
    )


def test_no_source_check_adds_anyway(api: Any, settings: Any) -> None:
    settings.LLMGW_SOURCE_ALLOWED_HOSTS = []
    response = api("alice").post("/api/v1/models?source_check=false", definition(), format="json")
    assert response.status_code == 201


def test_a_right_adapter_is_accepted(api: Any, files: str) -> None:
    add(api("alice"), source=f"{files}/tiny.gguf")
    response = api("alice").post(
        "/api/v1/models/tiny-chat/adapters",
        {"add": [{"name": "tiny-sql", "source": f"{files}/sql.gguf"}]},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert [a["name"] for a in response.json()] == ["tiny-sql"]


@pytest.mark.parametrize(
    "file, reason",
    [
        ("qwen-sql.gguf", "it is a LoRA adapter for qwen2, not for llama"),
        ("tiny.gguf", "it is a model, not an adapter (general.type is missing)"),
    ],
)
def test_a_wrong_adapter_is_refused_before_it_is_stored(
    api: Any, files: str, file: str, reason: str
) -> None:
    add(api("alice"), source=f"{files}/tiny.gguf")
    response = api("alice").post(
        "/api/v1/models/tiny-chat/adapters",
        {"add": [{"name": "bad", "source": f"{files}/{file}"}]},
        format="json",
    )
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "adapter_mismatch"
    assert reason in body["detail"]
    assert Model.objects.get().adapters == []


def test_a_model_added_with_a_wrong_adapter_is_refused(api: Any, files: str) -> None:
    adapters = [{"name": "bad", "source": f"{files}/qwen-sql.gguf"}]
    response = add(api("alice"), source=f"{files}/tiny.gguf", adapters=adapters)
    assert response.status_code == 400
    assert "not for llama" in response.json()["detail"]
    assert Model.objects.count() == 0
