"""/v1/rerank for a model defined with `reranking: true`: its engines rank documents (llama-server's
--reranking) instead of computing embeddings, the gateway sends each endpoint only to the models
whose engines serve it, and a ranking is charged its prompt's tokens.

The real llama.cpp server on the tiny model: a causal model's ranking is read from its last
token, so its scores are random, but the engine answers in the shape rerank clients read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.gateway.fake_engine import FakeEngine
from tests.support.engine import running_engine

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
]

DOCUMENTS = ["a cat is an animal", "paris is a city", "hello world", "llamas live in peru"]


@pytest.fixture(scope="module")
def ranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    folder = tmp_path_factory.mktemp("ranker")
    write_tiny_model(folder / "tiny.gguf", seed=1)
    with running_engine(
        folder / "tiny.gguf", alias="ranker", reranking=True, log=folder / "engine.log"
    ) as url:
        yield int(url.rsplit(":", 1)[1])


@pytest.fixture
def served(gw: Any, catalog: Any, ranker: int, engine: FakeEngine) -> Any:
    catalog.add("ranker", reranking=True)
    catalog.replica("ranker", ranker)
    catalog.add("chat")
    catalog.replica("chat", engine)
    return gw


def test_a_reranker_ranks_documents_and_is_charged_its_prompt(served: Any) -> None:
    answer = served.post(
        "/v1/rerank",
        {"model": "ranker", "query": "what is a cat?", "documents": DOCUMENTS, "top_n": 2},
    )
    assert answer.status_code == 200, answer.text
    ranked = answer.json()
    assert ranked["model"] == "ranker"
    assert len(ranked["results"]) == 2
    assert {r["index"] for r in ranked["results"]} <= set(range(len(DOCUMENTS)))
    scores = [r["relevance_score"] for r in ranked["results"]]
    assert scores == sorted(scores, reverse=True)
    prompt = ranked["usage"]["prompt_tokens"]
    assert prompt > 10
    metrics = served.get("/metrics").text
    assert f'llmgw_gateway_tokens_total{{kind="prompt",model="ranker"}} {prompt}.0' in metrics
    assert (
        'llmgw_gateway_requests_total{answered_by="ranker",endpoint="rerank",model="ranker",'
        'status="200"} 1.0'
    ) in metrics


def test_each_endpoint_goes_only_to_models_whose_engines_serve_it(
    served: Any, engine: FakeEngine
) -> None:
    refused = served.post("/v1/rerank", {"model": "chat", "query": "q", "documents": ["d"]})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "endpoint_not_served"
    assert "does not rank documents" in error["message"] and "reranking: true" in error["message"]
    no_vectors = served.post("/v1/embeddings", {"model": "ranker", "input": "hi"})
    assert no_vectors.status_code == 400
    assert "compute no embeddings" in no_vectors.json()["error"]["message"]
    assert engine.requests == []  # neither reached an engine
    # A body without what a ranking needs, refused before any engine.
    bare = served.post("/v1/rerank", {"model": "ranker", "query": "q"})
    assert bare.status_code == 400 and bare.json()["error"]["param"] == "documents"
