"""What a replica reserves: the declared memory_gb, or the weights plus every slot's KV cache
from the model file's GGUF header when that is more (fleet/footprint.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from catalog.models import Model
from fleet.footprint import FileFacts, footprint, known_facts
from fleet.models import ModelFile, Replica
from fleet.reconciler import reconcile_pass
from llmgw.tinygguf import write_tiny_model
from tests.support.http_files import serve_directory

pytestmark = pytest.mark.django_db

# The tiny model: 2 layers x 2 KV heads x (16 + 16) dims x 2 bytes = 256 bytes per token.
KV_PER_TOKEN = 256
MIB = 1024**2


@pytest.fixture
def tiny_url(tmp_path: Path, settings: Any) -> Iterator[str]:
    write_tiny_model(tmp_path / "tiny.gguf", seed=1, context_length=2048)
    with serve_directory(tmp_path) as (base_url, _stats):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(base_url).netloc]
        yield f"{base_url}/tiny.gguf"


def test_it_reserves_the_larger_of_declared_and_estimated() -> None:
    facts = FileFacts(weights_bytes=100 * MIB, kv_bytes_per_token=1024, trained_context=8192)
    # No context_length: the engine's default of 2048 per slot. 8 slots + the prompt cache.
    wide = footprint({"name": "cpu", "memory_gb": 0.1, "slots": 8}, facts, context_length=None)
    assert wide.estimate is not None
    assert wide.estimate.total_bytes == 100 * MIB + 9 * 2048 * 1024
    assert wide.memory_gb == pytest.approx(118 / 1024)
    assert wide.note().startswith("profile cpu reserves 118.00 MB (weights 100.00 MB + KV cache")
    roomy = footprint({"name": "cpu", "memory_gb": 4, "slots": 8}, facts, context_length=4096)
    assert roomy.memory_gb == 4 and roomy.note() == ""
    unknown = footprint(
        {"name": "cpu", "memory_gb": 0.1}, "the source did not answer", context_length=None
    )
    assert unknown.memory_gb == 0.1 and unknown.estimate is None


def test_a_node_takes_the_1_slot_replica_and_refuses_the_8_slot_one(
    fleet: Any, tiny_url: str
) -> None:
    # 1 slot: 0.7 MB weights + 2 x 512 KiB (its slot and the prompt cache), about 0.0016 GB.
    # 8 slots: 0.7 MB + 9 x 512 KiB, about 0.0049 GB. Both declare 0.001 GB, which would fit
    # twice over on this node; with their KV caches only the 1-slot one does.
    fleet.node("n1", memory_gb=0.003)
    fleet.add("solo", source=tiny_url, profiles=[{"name": "one", "memory_gb": 0.001, "slots": 1}])
    fleet.add("wide", source=tiny_url, profiles=[{"name": "eight", "memory_gb": 0.001, "slots": 8}])

    report = reconcile_pass()

    [solo] = Replica.objects.filter(model_name="solo")
    size = ModelFile.objects.get().weights_bytes
    assert size is not None
    assert solo.memory_gb * 1024**3 == pytest.approx(size + 2 * 2048 * KV_PER_TOKEN)
    assert not Replica.objects.filter(model_name="wide").exists()
    [unplaced] = report.unplaced
    assert unplaced.model == "wide"
    assert unplaced.reason.startswith("no node has 0.00")
    assert "GB memory free for profile eight; the largest free is 0.001" in unplaced.reason
    assert "KV cache 4.00 MB for 8 slots x 2048 tokens" in unplaced.reason
    assert unplaced.reason.endswith(
        "more than its memory_gb 0.001; fewer slots or a shorter context_length need less)"
    )


def test_profiles_are_tried_in_order_with_their_kv_caches(fleet: Any, tiny_url: str) -> None:
    fleet.node("n1", memory_gb=0.003)
    profiles = [
        {"name": "eight", "memory_gb": 0.001, "slots": 8},
        {"name": "one", "memory_gb": 0.001, "slots": 1},
    ]
    fleet.add("chat", source=tiny_url, profiles=profiles)
    reconcile_pass()
    assert [(r.profile, r.slots) for r in Replica.objects.all()] == [("one", 1)]


def test_an_unread_header_falls_back_to_the_declared_memory_and_is_asked_again(
    fleet: Any, api: Any
) -> None:
    fleet.node("n1", memory_gb=1)
    fleet.add(
        "far",
        source="http://127.0.0.1:9/tiny.gguf",
        profiles=[{"name": "cpu", "memory_gb": 0.5, "slots": 8}],
    )
    reconcile_pass()
    [replica] = Replica.objects.all()
    assert replica.memory_gb == 0.5
    [row] = ModelFile.objects.all()
    assert row.error and row.weights_bytes is None
    facts = known_facts(Model.objects.all())
    assert isinstance(facts["far"], str)

    plan = api("bob").get("/api/v1/models/far/plan").json()
    assert plan["estimate"] is None
    [warning] = plan["warnings"]
    assert warning.startswith("memory not estimated: ")
    assert warning.endswith(
        "until it is, placement reserves what each profile declares (cpu 0.5 GB)"
    )


def test_plan_shows_what_placement_reserves(api: Any, tiny_url: str) -> None:
    from tests.factories import definition as make

    body = make(
        name="est", source=tiny_url, profiles=[{"name": "cpu", "memory_gb": 0.001, "slots": 4}]
    )
    plan = api("bob").post("/api/v1/plan", body, format="json").json()
    estimate = plan["estimate"]
    assert estimate["slots"] == 4 and estimate["context_length"] == 2048
    assert estimate["kv_cache_bytes"] == 4 * 2048 * KV_PER_TOKEN
    assert estimate["reserved_gb"] == estimate["total_gb"] > 0.001
    [warning] = plan["warnings"]
    assert warning.startswith("profile cpu declares 0.001 GB, below the estimated")
    assert warning.endswith("placement reserves the estimate")


def test_what_a_plan_read_is_forgotten_when_no_model_uses_it(
    fleet: Any, api: Any, tiny_url: str
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from fleet.footprint import file_key, forget_unused
    from fleet.tasks import forget_unused_files
    from tests.factories import definition as make

    fleet.node("n1", memory_gb=1)
    fleet.add("kept", source=tiny_url, profiles=[{"name": "cpu", "memory_gb": 0.5}])
    Model.objects.filter(name="kept").update(
        previous={"source": f"{tiny_url}?v=1", "sha256": "", "origin": None}
    )
    for source in (f"{tiny_url}?v=1", f"{tiny_url}?plan-only"):
        body = make(name="est", source=source, profiles=[{"name": "cpu", "memory_gb": 0.5}])
        assert api("bob").post("/api/v1/plan", body, format="json").status_code == 200
    reconcile_pass()
    forget_unused_files()  # as beat runs it
    assert ModelFile.objects.count() == 3  # the served file, its previous one and the plan's

    forget_unused(Model.objects.all(), now=timezone.now() + timedelta(minutes=30))
    assert ModelFile.objects.count() == 3  # read lately: kept a while

    forget_unused(Model.objects.all(), now=timezone.now() + timedelta(hours=2))
    kept = Model.objects.get(name="kept")
    assert set(ModelFile.objects.values_list("source", flat=True)) == {
        tiny_url,
        f"{tiny_url}?v=1",
    }
    assert ModelFile.objects.filter(key=file_key(kept)).exists()


# -- GPU profiles: the offloaded share on the GPUs, the rest in host memory --------------------


def gpu_facts() -> FileFacts:
    # 100 MB of weights, 1 KB of KV cache per token, 10 layers.
    return FileFacts(100 * MIB, 1024, trained_context=8192, block_count=10)


def test_a_gpu_profile_holds_every_layer_on_its_gpus_by_default() -> None:
    # 2 slots x 2048 tokens x 1 KB = 4 MB of KV cache, and a 2 MB prompt cache in host memory.
    profile = {"name": "gpu", "memory_gb": 0, "slots": 2, "gpus": 1, "gpu_memory_gb": 0}
    memory = footprint(profile, gpu_facts(), context_length=2048)
    assert memory.offloaded == 1.0
    assert memory.gpu_bytes == 104 * MIB
    assert memory.host_bytes == 2 * MIB  # the prompt cache (--cache-ram) stays in host memory
    assert memory.gpu_memory_gb_per_gpu == pytest.approx(104 / 1024)
    assert memory.memory_gb == pytest.approx(2 / 1024)
    assert memory.note().startswith(
        "profile gpu reserves 2.00 MB (weights 100.00 MB + KV cache 4.00 MB for 2 slots x 2048 "
        "tokens + prompt cache 2.00 MB, less 104.00 MB on its GPUs), more than its memory_gb 0; "
        "profile gpu reserves 104.00 MB on each of its 1 GPU (every layer of weights 100.00 MB + "
        "KV cache 4.00 MB, split over its GPUs), more than its gpu_memory_gb 0"
    )


def test_gpu_layers_offload_their_share_and_gpus_split_it() -> None:
    profile = {"name": "gpu", "memory_gb": 0, "slots": 2, "gpus": 2, "gpu_layers": 4}
    memory = footprint(profile, gpu_facts(), context_length=2048)
    # 4 of 10 layers: 40% of 104 MB on the GPUs (20.8 MB on each of 2), the rest in host memory.
    assert memory.offloaded == 0.4
    assert memory.gpu_bytes == int(104 * MIB * 0.4)
    assert memory.host_bytes == 106 * MIB - memory.gpu_bytes
    assert memory.gpu_memory_gb_per_gpu == pytest.approx(104 * 0.4 / 2 / 1024)
    assert memory.gpu_memory_gb == pytest.approx(2 * memory.gpu_memory_gb_per_gpu)


def test_the_declared_gpu_memory_is_a_floor_and_an_unknown_layer_count_offloads_all() -> None:
    profile = {"name": "gpu", "memory_gb": 0, "gpus": 1, "gpu_memory_gb": 8, "gpu_layers": 3}
    memory = footprint(profile, gpu_facts(), context_length=2048)
    assert memory.gpu_memory_gb_per_gpu == 8 and not memory.gpu_above_declared
    unknown = FileFacts(100 * MIB, 1024, trained_context=8192, block_count=None)
    profile = {**profile, "gpu_memory_gb": 0}
    assert footprint(profile, unknown, context_length=2048).offloaded == 1.0
    # A count above the model's layers offloads them all, as llama-server does.
    profile = {**profile, "gpu_layers": 99}
    assert footprint(profile, gpu_facts(), context_length=2048).offloaded == 1.0


def test_a_gpu_replica_reserves_the_estimate_on_its_device(fleet: Any, tiny_url: str) -> None:
    node = fleet.node("g", memory_gb=1)
    node.devices = [
        {"index": 0, "uuid": "", "name": "x", "memory_total_mb": 1024, "memory_used_mb": 0}
    ]
    node.engine_backends = ["CPU", "CUDA"]
    node.save(update_fields=["devices", "engine_backends"])
    fleet.add("chat", source=tiny_url, profiles=[{"name": "gpu", "memory_gb": 0, "gpus": 1}])
    reconcile_pass()  # reads the header, then places
    [row] = ModelFile.objects.all()
    assert row.block_count == 2  # the tiny model's layers
    [replica] = Replica.objects.all()
    assert replica.devices == [0]
    # Weights + 1 slot of KV cache on the GPU; the prompt cache in host memory.
    one_slot = 2048 * KV_PER_TOKEN
    assert replica.gpu_memory_gb * 1024**3 == pytest.approx(row.weights_bytes + one_slot)
    assert replica.memory_gb * 1024**3 == pytest.approx(one_slot)


def test_plan_shows_what_a_gpu_profile_holds_on_its_gpus(api: Any, tiny_url: str) -> None:
    from tests.factories import definition as make

    gpu = {"name": "gpu", "memory_gb": 0, "gpus": 1, "gpu_layers": 1}
    plan = api("bob").post("/api/v1/plan", make(source=tiny_url, profiles=[gpu]), format="json")
    estimate = plan.json()["estimate"]
    # 1 of the tiny model's 2 layers: half its weights and KV cache on the GPU.
    on_layers = estimate["weights_bytes"] + estimate["kv_cache_bytes"]
    assert (estimate["gpus"], estimate["gpu_layers"], estimate["offloaded"]) == (1, 1, 0.5)
    assert estimate["gpu_bytes"] == on_layers // 2
    assert estimate["host_bytes"] == estimate["total_bytes"] - estimate["gpu_bytes"]
    assert estimate["gpu_reserved_gb_per_gpu"] == round(on_layers / 2 / 1024**3, 3)
    assert estimate["reserved_gb"] == round(estimate["host_bytes"] / 1024**3, 3)
