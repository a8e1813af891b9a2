"""A model's replicas go only to nodes that have its engine (fleet.placement), and a definition
asks of its engine only what the engine does (catalog.definitions), and the node is told a
replica's engine and files (fleet.services.replica_order)."""

from __future__ import annotations

from typing import Any

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


@pytest.mark.django_db
def test_the_node_is_told_the_engine_the_files_and_reranking_and_only_a_node_with_vllm(
    fleet: Any,
) -> None:
    from fleet.models import Replica
    from fleet.reconciler import reconcile_pass
    from fleet.services import replica_order
    from llmgw.node.spec import ReplicaSpec

    fleet.node("plain", memory_gb=16, cores=4)  # an agent that does not say: llama.cpp
    both = fleet.node("both", memory_gb=16, cores=4)
    both.engines = ["llama.cpp", "vllm"]
    both.save(update_fields=["engines"])
    files = ["tokenizer.json", "model.safetensors"]
    fleet.add("snap", engine="vllm", source=SNAPSHOT, files=files, min_replicas=2)
    fleet.add("ranker", reranking=True)

    report = reconcile_pass()

    assert report.unplaced == []
    snap = Replica.objects.filter(model_name="snap").select_related("node")
    assert [r.node.name for r in snap] == ["both", "both"]
    assert Replica.objects.filter(model_name="ranker").count() == 1
    for replica in Replica.objects.select_related("node"):
        order = replica_order(replica, replica.node)
        spec = ReplicaSpec.from_json(order)  # as the node reads it
        if replica.model_name == "snap":
            assert spec.engine == "vllm"
            assert [f.path for f in spec.files] == files
            assert [f.source for f in spec.files] == [
                SNAPSHOT.removesuffix("config.json") + path for path in files
            ]
        else:
            assert (spec.engine, spec.files, spec.reranking) == ("llama.cpp", (), True)


@pytest.mark.django_db
def test_a_vllm_replica_on_a_gpu_is_told_the_share_of_the_device_placement_reserved(
    fleet: Any, tmp_path: Any
) -> None:
    from fleet.models import Replica
    from fleet.reconciler import reconcile_pass
    from fleet.services import replica_order
    from llmgw.engines import get_engine
    from llmgw.engines.base import EngineSettings
    from llmgw.node.spec import ReplicaSpec

    node = fleet.node("g", memory_gb=16, cores=4)
    # As a stand-in nvidia-smi reports them: a 24 GB device and a 16 GB one, nothing in use.
    node.devices = [
        {"index": i, "uuid": f"GPU-{i}", "name": "L4", "memory_total_mb": mb,
         "memory_used_mb": 0, "utilization_pct": 0}
        for i, mb in ((0, 24576), (1, 16384))
    ]  # fmt: skip
    node.devices_source, node.engines, node.gpu_engines = "nvml", ["vllm"], ["vllm"]
    node.save(update_fields=["devices", "devices_source", "engines", "gpu_engines"])
    gpu = {"name": "gpu", "memory_gb": 3, "cores": 1, "gpus": 1, "gpu_memory_gb": 6}
    fleet.add("snap", engine="vllm", source=SNAPSHOT, files=["m.safetensors"], profiles=[gpu])
    fleet.add("snap2", engine="vllm", source=SNAPSHOT, files=["m.safetensors"], profiles=[gpu])

    reconcile_pass()

    replicas = list(Replica.objects.select_related("node").order_by("model_name"))
    assert [r.devices for r in replicas] == [[0], [0]]  # both on the roomier device: it holds two
    for replica in replicas:
        spec = ReplicaSpec.from_json(replica_order(replica, replica.node))
        assert spec.devices == (0,) and spec.gpu_memory_share == 0.25  # 6 GB of 24
        settings = EngineSettings(
            model_path=str(tmp_path), model_alias="snap", host="127.0.0.1", port=18001,
            context_length=512, devices=spec.devices, device_uuids=spec.device_uuids,
            gpu_layers=spec.gpu_layers, gpu_memory_share=spec.gpu_memory_share,
        )  # fmt: skip
        command = get_engine("vllm").command(settings, "python")
        assert command[command.index("--gpu-memory-utilization") + 1] == "0.25"


def test_a_vllm_adapter_is_named_by_its_adapter_config() -> None:
    base = "http://127.0.0.1:8000/mirror/acme/tiny-lora/0123abc/"
    fields = {"engine": "vllm", "source": SNAPSHOT, "files": ["a.safetensors"]}
    good = {"name": "sql", "source": base + "adapter_config.json"}
    assert clean_definition(definition(**fields, adapters=[good]))["adapters"][0]["name"] == "sql"
    found = problems(**fields, adapters=[{"name": "sql", "source": base + "adapter.gguf"}])
    assert "an adapter's source is its adapter_config.json" in found["adapters"]


def test_a_gpu_profile_goes_where_its_engine_can_use_the_gpus() -> None:
    from fleet.placement import Device

    gpu = Profile("gpu", res(4, 1, 1, 8))
    cuda_llama = Node(
        "a", res(32, 8), devices=(Device(0, 24),), engines=frozenset({"llama.cpp", "vllm"}),
        gpu_engines=frozenset({"llama.cpp"}),
    )  # fmt: skip
    cuda_vllm = Node(
        "b", res(32, 8), devices=(Device(0, 24),), engines=frozenset({"llama.cpp", "vllm"}),
        gpu_engines=frozenset({"vllm"}),
    )  # fmt: skip
    models = [
        ModelDemand("v", "standard", 1, 1, (gpu,), engine="vllm"),
        ModelDemand("l", "standard", 1, 1, (gpu,), engine="llama.cpp"),
    ]
    plan = plan_placement([cuda_llama, cuda_vllm], models, [])
    assert sorted((s.model, s.node) for s in plan.starts) == [("l", "a"), ("v", "b")]

    plan = plan_placement([cuda_llama], [models[0]], [])
    (unplaced,) = plan.unplaced
    assert unplaced.reason.startswith("no node's vllm can use its GPUs")


def test_a_node_reports_its_engines_and_which_use_its_gpus(api: Any) -> None:
    from fleet.models import Node
    from tests.fleet.test_gpu_devices import beat, gpu, node_client

    node = node_client(api)
    body = beat(
        [gpu(0)],
        engines=["llama.cpp", "vllm", "tgi"],  # a name llmgw does not know is not believed
        gpu_engines=["vllm", "sglang"],
        engine_backends=["CPU"],
    )
    assert node.post("/api/v1/node/heartbeat", body, format="json").status_code == 200
    stored = Node.objects.get()
    assert (stored.engines, stored.gpu_engines) == (["llama.cpp", "vllm"], ["vllm"])
    view = api("alice").get("/api/v1/nodes").json()[0]
    assert (view["engines"], view["gpu_engines"]) == (["llama.cpp", "vllm"], ["vllm"])


@pytest.mark.django_db
def test_an_agent_that_does_not_say_is_llama_cpp_on_gpus_when_its_binary_has_a_backend(
    fleet: Any,
) -> None:
    from fleet.reconciler import node_engines, node_gpu_engines

    node = fleet.node("n", memory_gb=8, cores=2)
    assert (node_engines(node), node_gpu_engines(node)) == (["llama.cpp"], [])
    node.engine_backends = ["CPU", "CUDA"]
    assert node_gpu_engines(node) == ["llama.cpp"]
