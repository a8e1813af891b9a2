"""A model's vision projector in the fleet: a replica reserves its bytes with the weights',
its spec (and so its revision and key) carries it, and a node is told to run it and to keep
the previous revision's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from catalog.models import Model
from fleet.footprint import file_key
from fleet.models import ModelFile, Replica
from fleet.reconciler import reconcile_pass
from fleet.specs import current_keys, replica_revision, replica_spec, weights_revision
from llmgw.tinygguf import write_tiny_mmproj, write_tiny_model
from tests.support.http_files import serve_directory

pytestmark = pytest.mark.django_db

KV_PER_TOKEN = 256  # the tiny model's, as in test_footprint


@pytest.fixture
def files(tmp_path: Path, settings: Any) -> Iterator[str]:
    write_tiny_model(tmp_path / "tiny.gguf", seed=1, context_length=2048)
    write_tiny_mmproj(tmp_path / "mmproj.gguf", seed=1)
    with serve_directory(tmp_path) as (base_url, _stats):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(base_url).netloc]
        yield base_url


def test_a_replica_reserves_the_projector_with_the_weights(
    fleet: Any, files: str, tmp_path: Path
) -> None:
    fleet.node("n1", memory_gb=1)
    one = [{"name": "one", "memory_gb": 0.001, "slots": 1}]
    fleet.add("text", source=f"{files}/tiny.gguf", profiles=one)
    fleet.add("vision", source=f"{files}/tiny.gguf", mmproj="mmproj.gguf", profiles=one)

    reconcile_pass()

    weights = (tmp_path / "tiny.gguf").stat().st_size
    projector = (tmp_path / "mmproj.gguf").stat().st_size
    kv = 2 * 2048 * KV_PER_TOKEN  # its slot and the prompt cache
    [text] = Replica.objects.filter(model_name="text")
    [vision] = Replica.objects.filter(model_name="vision")
    assert text.memory_gb * 1024**3 == pytest.approx(weights + kv)
    assert vision.memory_gb * 1024**3 == pytest.approx(weights + projector + kv)
    # Two files read apart: the same weights with a projector are another model file.
    assert ModelFile.objects.count() == 2


def test_a_projector_that_is_not_there_leaves_the_declared_memory(fleet: Any, files: str) -> None:
    fleet.node("n1", memory_gb=1)
    fleet.add(
        "vision",
        source=f"{files}/tiny.gguf",
        mmproj="gone.gguf",
        profiles=[{"name": "one", "memory_gb": 0.25}],
    )
    reconcile_pass()
    row = ModelFile.objects.get(key=file_key(Model.objects.get(name="vision")))
    assert row.weights_bytes is None
    assert row.error.startswith("its vision projector: The projector 'gone.gguf'")
    assert Replica.objects.get(model_name="vision").memory_gb == 0.25


def test_the_spec_carries_the_projector_and_a_text_models_is_unchanged(fleet: Any) -> None:
    text = fleet.add("text")
    profile = text.profiles[0]
    before = replica_spec(text, profile)
    assert "mmproj" not in before
    vision = fleet.add("vision", mmproj="mmproj.gguf")
    spec = replica_spec(vision, vision.profiles[0])
    folder = vision.source.rsplit("/", 1)[0]
    assert spec["mmproj"] == {
        "path": "mmproj.gguf",
        "source": f"{folder}/mmproj.gguf",
        "sha256": None,
    }
    assert current_keys(vision) != current_keys(text)


def test_the_revision_is_the_pair_of_files() -> None:
    weights = "a" * 64
    alone = weights_revision("http://m/w.gguf", weights)
    assert alone == weights[:12]  # a text model's revision is what it always was
    one = {"source": "http://m/c1/mmproj.gguf", "sha256": "b" * 64}
    other = {"source": "http://m/c2/mmproj.gguf", "sha256": "c" * 64}
    assert weights_revision("http://m/w.gguf", weights, one) not in (alone, weights[:12])
    # A new projector alone is a new revision; the same files are the same revision.
    assert weights_revision("http://m/w.gguf", weights, one) != weights_revision(
        "http://m/w.gguf", weights, other
    )
    spec = {"source": "http://m/w.gguf", "sha256": weights, "mmproj": one}
    assert replica_revision(spec) == weights_revision("http://m/w.gguf", weights, one)


def test_the_node_is_told_the_projector_and_to_keep_the_previous_ones(fleet: Any) -> None:
    fleet.node("n1", memory_gb=8)
    model = fleet.add("vision", mmproj="mmproj.gguf")
    reconcile_pass()
    folder = model.source.rsplit("/", 1)[0]
    previous_source = model.source.replace("/0123abc/", "/0000old/")
    Model.objects.filter(pk=model.pk).update(
        previous={"source": previous_source, "sha256": "", "origin": None}
    )
    answer = fleet.beat("n1")
    [order] = answer["replicas"]
    assert order["mmproj"] == {
        "path": "mmproj.gguf",
        "source": f"{folder}/mmproj.gguf",
        "sha256": None,
    }
    old_folder = previous_source.rsplit("/", 1)[0]
    assert {"source": f"{old_folder}/mmproj.gguf", "sha256": None} in answer["keep"]
    assert {"source": previous_source, "sha256": None} in answer["keep"]
