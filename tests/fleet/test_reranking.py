"""A reranker (a model defined with `reranking: true`) from its definition to its engine's
command line: the catalog keeps it, its replicas' spec carries it (a text model's spec, and so
its key, unchanged), the node reads it both ways, and the engine is started with --reranking
instead of --embeddings."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from catalog.models import Model
from fleet.specs import replica_spec
from llmgw.engine import EngineSettings, engine_command
from llmgw.node.spec import AnswerError, ReplicaSpec

pytestmark = pytest.mark.django_db


def test_a_reranker_is_kept_and_its_spec_says_so(fleet: Any) -> None:
    fleet.add("ranker", reranking=True)
    fleet.add("chat")
    ranker, chat = Model.objects.get(name="ranker"), Model.objects.get(name="chat")
    assert ranker.reranking and not chat.reranking
    assert ranker.definition()["reranking"] is True
    assert "reranking" not in chat.definition()  # the definition a text model had
    profile = {"name": "cpu", "memory_gb": 1, "cores": 1}
    assert replica_spec(ranker, profile)["reranking"] is True
    assert "reranking" not in replica_spec(chat, profile)


def test_the_api_takes_it_and_refuses_what_is_not_a_flag(api: Any) -> None:
    from tests.factories import definition

    client = api("alice")
    url = "/api/v1/models?source_check=false"
    refused = client.post(url, definition("ranker", reranking="sometimes"), format="json")
    assert refused.status_code == 400
    [problem] = refused.json()["problems"]
    assert problem["field"] == "reranking"
    assert not Model.objects.filter(name="ranker").exists()
    made = client.post(url, definition("ranker", reranking=True), format="json")
    assert made.status_code == 201, made.json()
    assert made.json()["definition"]["reranking"] is True


def test_the_node_reads_it_and_starts_the_engine_for_it() -> None:
    data = {"id": str(uuid.uuid4()), "model": "ranker", "source": "http://m/c1/w.gguf"}
    spec = ReplicaSpec.from_json({**data, "reranking": True})
    assert spec.reranking and spec.to_json()["reranking"] is True
    assert ReplicaSpec.from_json(spec.to_json()) == spec
    plain = ReplicaSpec.from_json(data)
    assert not plain.reranking and "reranking" not in plain.to_json()
    with pytest.raises(AnswerError, match="reranking is 'yes', not true or false"):
        ReplicaSpec.from_json({**data, "reranking": "yes"})

    settings = EngineSettings(
        model_path="w.gguf", model_alias="ranker", host="127.0.0.1", port=1, context_length=256
    )
    ranking = engine_command(EngineSettings(**{**settings.__dict__, "reranking": True}), "ls")
    embedding = engine_command(settings, "ls")
    assert "--reranking" in ranking and "--embeddings" not in ranking
    assert "--embeddings" in embedding and "--reranking" not in embedding
