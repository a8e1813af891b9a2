"""A model's replicas go only to nodes that have its engine (fleet.placement), and a definition
asks of its engine only what the engine does (catalog.definitions). Pure: no database."""

from __future__ import annotations

import pytest

from catalog.definitions import clean_definition
from core.refusals import Refused
from fleet.placement import ModelDemand, Node, Profile, Replica, plan_placement
from tests.factories import definition
from tests.support.placement import res

CPU = Profile("cpu", res(4, 1))


def node(name: str, *engines: str, memory: float = 16) -> Node:
    return Node(name, res(memory, 8), engines=frozenset(engines))


def model(name: str, engine: str = "", desired: int = 1, klass: str = "standard") -> ModelDemand:
    return ModelDemand(name, klass, desired, desired, (CPU,), engine=engine)


def test_a_vllm_model_goes_only_to_a_node_that_has_vllm() -> None:
    nodes = [node("a-llama", "llama.cpp"), node("b-both", "llama.cpp", "vllm")]
    plan = plan_placement(nodes, [model("v", "vllm", desired=2), model("l", "llama.cpp")], [])
    assert sorted((s.model, s.node) for s in plan.starts) == [
        ("l", "a-llama"),
        ("v", "b-both"),
        ("v", "b-both"),
    ]


def test_with_no_node_of_its_engine_it_is_unplaced_and_says_so() -> None:
    plan = plan_placement([node("a", "llama.cpp")], [model("v", "vllm")], [])
    assert plan.starts == ()
    (unplaced,) = plan.unplaced
    assert unplaced.reason.startswith("no schedulable node has the engine vllm")


def test_it_preempts_only_on_a_node_of_its_engine() -> None:
    # Both nodes are full of an opportunistic model; the critical vLLM model may preempt, but
    # only on the node that has vLLM.
    nodes = [node("a", "llama.cpp", memory=4), node("b", "llama.cpp", "vllm", memory=4)]
    running = [
        Replica("r-a", "filler", "a", "cpu", res(4, 1)),
        Replica("r-b", "filler", "b", "cpu", res(4, 1)),
    ]
    models = [
        model("filler", desired=2, klass="opportunistic"),
        model("v", "vllm", klass="critical"),
    ]
    plan = plan_placement(nodes, models, running)
    assert [(s.model, s.node) for s in plan.starts] == [("v", "b")]
    assert [p.replica_id for p in plan.preemptions] == ["r-b"]


def test_a_node_that_does_not_say_takes_every_engine() -> None:
    plan = plan_placement([Node("old", res(16, 8))], [model("v", "vllm")], [])
    assert [(s.model, s.node) for s in plan.starts] == [("v", "old")]


SNAPSHOT = "http://127.0.0.1:8000/mirror/acme/tiny-llama/0123abc/config.json"


def problems(**fields: object) -> dict[str, str]:
    with pytest.raises(Refused) as caught:
        clean_definition(definition(**fields))
    return {p.field: p.message for p in caught.value.problems}


def test_a_vllm_definition_names_its_snapshot() -> None:
    clean = clean_definition(
        definition(
            engine="vllm",
            source=SNAPSHOT,
            files=["tokenizer.json", "model-00001-of-00002.safetensors", "weights/b.safetensors"],
        )
    )
    assert clean["engine"] == "vllm" and len(clean["files"]) == 3


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"engine": "sglang"}, "engine", "is not an engine llmgw runs"),
        ({"files": ["tokenizer.json"]}, "files", "llama.cpp loads one weights file"),
        (
            {"engine": "vllm", "files": ["model.safetensors"]},
            "source",
            "the source is its config.json",
        ),
        ({"engine": "vllm", "source": SNAPSHOT, "files": ["tokenizer.json"]}, "files", "at least one .safetensors"),
        ({"engine": "vllm", "source": SNAPSHOT, "files": ["../x.safetensors"]}, "files[0]", "not a file of the weights' repository"),
        ({"engine": "vllm", "source": SNAPSHOT, "files": ["a.safetensors", "a.safetensors"]}, "files", "named twice"),
        (
            {"engine": "vllm", "source": SNAPSHOT, "files": ["a.safetensors"], "mmproj": "p.gguf"},
            "mmproj",
            "takes no separate projector",
        ),
        (
            {"engine": "vllm", "source": SNAPSHOT, "files": ["a.safetensors"], "reranking": True},
            "reranking",
            "not run as a reranker",
        ),
    ],
)  # fmt: skip
def test_a_definition_asks_of_its_engine_only_what_it_does(
    fields: dict[str, object], field: str, words: str
) -> None:
    found = problems(**fields)
    assert field in found, found
    assert words in found[field]
