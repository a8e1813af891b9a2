"""A model's vision projector (mmproj) as a definition field: accepted and shown by the API,
server.yaml and the admin's YAML alike, refused with a clear 400 when it is not a file name of
the weights' repository, and asked for at its source like the weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from catalog.definitions import clean_definition
from catalog.models import Model, projector_of, projector_source, repository_folder
from core.refusals import Refused
from llmgw.tinygguf import write_tiny_mmproj, write_tiny_model
from tests.factories import definition
from tests.support.http_files import serve_directory

pytestmark = pytest.mark.django_db

NO_CHECK = "/api/v1/models?source_check=false"
MIRROR = "http://127.0.0.1:8000/mirror/acme/vision/0123abc"


def add(client: Any, url: str = NO_CHECK, **overrides: Any) -> Any:
    return client.post(url, definition(**overrides), format="json")


def test_it_is_stored_shown_and_given_back_in_the_definition(api: Any) -> None:
    response = add(api("alice"), mmproj="mmproj-vision-f16.gguf")
    assert response.status_code == 201, response.json()
    assert response.json()["definition"]["mmproj"] == "mmproj-vision-f16.gguf"
    model = Model.objects.get()
    assert model.mmproj == "mmproj-vision-f16.gguf"
    # `model add -f` takes the definition back unchanged.
    assert clean_definition(model.definition())["mmproj"] == "mmproj-vision-f16.gguf"


def test_a_text_model_has_none_and_its_definition_does_not_name_it(api: Any) -> None:
    assert add(api("alice")).status_code == 201
    model = Model.objects.get()
    assert model.mmproj == "" and model.projector is None
    assert "mmproj" not in model.definition()


@pytest.mark.parametrize(
    "bad",
    [
        "../other-repo/mmproj.gguf",
        "/etc/mmproj.gguf",
        "vision/./mmproj.gguf",
        "vision//mmproj.gguf",
        "mmproj.bin",
        "mm proj.gguf",
        "mmproj%2e.gguf",
        "vision\\mmproj.gguf",
        "-mmproj.gguf",
        "x" * 500 + ".gguf",
    ],
)
def test_a_bad_name_is_a_400_and_changes_nothing(api: Any, bad: str) -> None:
    response = add(api("alice"), mmproj=bad)
    assert response.status_code == 400, response.json()
    [problem] = response.json()["problems"]
    assert problem["field"] == "mmproj"
    if len(bad) > 500:
        assert problem["message"] == "a projector's path is at most 500 characters"
    else:
        assert problem["message"] == (
            f"{bad!r} is not a projector file: name the .gguf file by its path in the weights' "
            "repository, like mmproj-model-f16.gguf or vision/mmproj.gguf (letters, digits, "
            "'.', '_' and '-', folders separated by '/', no '..'), or leave mmproj out for a "
            "model without images"
        )
    assert not Model.objects.exists()


def test_an_empty_name_is_refused_with_the_way_to_say_none(api: Any) -> None:
    response = add(api("alice"), mmproj="")
    assert response.status_code == 400
    [problem] = response.json()["problems"]
    assert (problem["field"], problem["message"]) == (
        "mmproj",
        "an empty name is no projector: leave mmproj out for a model without images",
    )


def test_the_weights_file_itself_is_not_a_projector(api: Any) -> None:
    response = add(api("alice"), mmproj="tiny-chat.gguf")
    assert response.status_code == 400
    [problem] = response.json()["problems"]
    assert (problem["field"], problem["message"]) == (
        "mmproj",
        "'tiny-chat.gguf' is the weights' own file; name the projector, a separate .gguf file "
        "of the same repository",
    )
    assert not Model.objects.exists()


def test_server_yaml_declares_it(server_yaml: Any) -> None:
    from catalog.config import load_config
    from catalog.services import config_apply

    path = server_yaml({"models": [definition(name="vision", mmproj="vision/mmproj.gguf")]})
    config_apply(load_config(path))
    assert Model.objects.get(name="vision").mmproj == "vision/mmproj.gguf"


def test_server_yaml_refuses_a_bad_one_naming_the_entry(server_yaml: Any) -> None:
    from catalog.config import ConfigError, load_config

    path = server_yaml({"models": [definition(name="vision", mmproj="../x.gguf")]})
    with pytest.raises((ConfigError, Refused)) as caught:
        load_config(path)
    assert "mmproj" in str(caught.value) and "is not a projector file" in str(caught.value)


# -- where the projector is: beside the weights, at their revision ---------------------------


def test_in_the_mirror_it_is_named_from_the_repository_top(settings: Any) -> None:
    settings.LLMGW_PUBLIC_URL = "http://127.0.0.1:8000"
    source = f"{MIRROR}/q4/vision-q4.gguf"
    assert repository_folder(source) == f"{MIRROR}/"
    assert projector_source(source, "mmproj.gguf") == f"{MIRROR}/mmproj.gguf"


def test_elsewhere_it_is_beside_the_weights() -> None:
    source = "http://files.example/models/vision-q4.gguf?download=1"
    assert projector_source(source, "mmproj.gguf") == "http://files.example/models/mmproj.gguf"


def test_its_checksum_and_size_come_from_the_origin_at_that_commit(settings: Any) -> None:
    settings.LLMGW_PUBLIC_URL = "http://127.0.0.1:8000"
    origin = {
        "commit": "0123abc",
        "files": [
            {"path": "vision-q4.gguf", "sha256": "a" * 64, "size": 10},
            {"path": "mmproj.gguf", "sha256": "b" * 64, "size": 7},
        ],
    }
    projector = projector_of(f"{MIRROR}/vision-q4.gguf", "mmproj.gguf", origin)
    assert projector is not None
    assert (projector.source, projector.sha256, projector.size) == (
        f"{MIRROR}/mmproj.gguf",
        "b" * 64,
        7,
    )
    assert projector_of(f"{MIRROR}/vision-q4.gguf", "", origin) is None


# -- the source check -----------------------------------------------------------------------


@pytest.fixture
def files(tmp_path: Path, settings: Any) -> Iterator[str]:
    write_tiny_model(tmp_path / "tiny.gguf", seed=1)
    write_tiny_mmproj(tmp_path / "mmproj.gguf", seed=1)
    with serve_directory(tmp_path) as (base_url, _stats):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(base_url).netloc]
        yield base_url


def test_the_projector_is_asked_for_like_the_weights(api: Any, files: str) -> None:
    url = "/api/v1/models"
    ok = add(api("alice"), url, source=f"{files}/tiny.gguf", mmproj="mmproj.gguf")
    assert ok.status_code == 201, ok.json()
    missing = add(
        api("alice"), url, name="other", source=f"{files}/tiny.gguf", mmproj="absent.gguf"
    )
    assert missing.status_code == 400, missing.json()
    assert missing.json()["code"] == "source_missing"
    assert missing.json()["detail"].startswith(
        f"The projector 'absent.gguf' {files}/absent.gguf is not there: it answered 404"
    )
    assert not Model.objects.filter(name="other").exists()
