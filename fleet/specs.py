"""What a replica is started with, and how to tell that it is out of date."""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from typing import Any

from django.conf import settings

from catalog.definitions import ALL_LAYERS, DEFAULT_SLOTS
from catalog.models import Model
from llmgw.engines import DEFAULT_ENGINE


def engine_key(replica_id: str) -> str:
    """The key a replica's engine is started with (from a file the node writes, never its command line) and the
    gateway sends it: without it the engine answers nothing but /health.

    Derived from the installation's secret (LLMGW_SECRET_KEY) and the replica's id, so it is
    stored nowhere, every control-plane machine knows it, and a node is told only the keys of
    its own replicas (in its heartbeat's answer). Changing the secret changes every key: running
    engines then refuse the gateway until they are started again (stop each node's agent with
    its engines, `--stop-engines-on-exit`, and start it again)."""
    # Django's salted_hmac(ENGINE_KEY_SALT, replica_id, algorithm="sha256"), with its key made
    # once per secret rather than once a replica: a gateway process reading 20,000 replicas
    # spent 40 % of the read here.
    key = _engine_hmac_key(ENGINE_KEY_SALT, settings.SECRET_KEY)
    return hmac.new(key, replica_id.encode(), hashlib.sha256).hexdigest()


ENGINE_KEY_SALT = "llmgw.engine-key"


@functools.lru_cache(maxsize=4)  # one secret at a time; a test may set another
def _engine_hmac_key(salt: str, secret: str) -> bytes:
    return hashlib.sha256((salt + secret).encode()).digest()


def profile_slots(profile: dict[str, Any]) -> int:
    """Requests a replica of this profile serves at once."""
    return int(profile.get("slots") or DEFAULT_SLOTS)


def profile_gpu_layers(profile: dict[str, Any]) -> int | str:
    """Layers a replica of this profile offloads to its GPUs: none without GPUs, else the
    profile's gpu_layers ("all" when it does not say)."""
    if not profile.get("gpus"):
        return 0
    layers = profile.get("gpu_layers")
    return ALL_LAYERS if layers is None else layers


def replica_spec(model: Model, profile: dict[str, Any]) -> dict[str, Any]:
    """Everything that, when it changes, means a running replica must be replaced.

    ``gpu_layers`` is in it only for a GPU profile: a CPU replica's spec stays what it was, and
    a GPU replica started before layers were offloaded (a CPU-only engine) is out of date, so
    it is replaced by one that uses its GPUs."""
    gpu = {"gpu_layers": profile_gpu_layers(profile)} if profile.get("gpus") else {}
    return {
        "source": model.source,
        "sha256": model.sha256 or None,
        "adapters": [
            {
                "name": a["name"],
                "source": a["source"],
                "sha256": a.get("sha256"),
                "scale": a.get("scale", 1.0),
            }
            for a in model.adapters
        ],
        "context_length": model.context_length,
        # Only for a model with a projector: a text model's spec (and key) stays what it was.
        **({"mmproj": projector.spec()} if (projector := model.projector) else {}),
        # Only for a reranker: any other model's spec (and key) stays what it was.
        **({"reranking": True} if model.reranking else {}),
        # Only for a model of another engine than the default, and for a snapshot's files: a
        # default engine's model's spec (and key) stays what it was.
        **({"engine": model.engine_name} if model.engine_name != DEFAULT_ENGINE else {}),
        **({"files": [f.spec() for f in model.snapshot_files]} if model.files else {}),
        "slots": profile_slots(profile),
        "generation": model.generation,
        "resources": {
            "memory_gb": profile["memory_gb"],
            "cores": profile.get("cores", 0),
            "gpus": profile.get("gpus", 0),
            "gpu_memory_gb": profile.get("gpu_memory_gb", 0),
        },
        **gpu,
    }


def gpu_order(
    spec: dict[str, Any],
    devices: list[int],
    node_devices: list[Any],
    reserved_gb: float = 0.0,
) -> dict[str, Any]:
    """What a node is told about a replica's GPUs (the heartbeat answer): the device indices it
    was placed on, their UUIDs as the node reported them ("" when unknown), the layers to
    offload, and the share of the layers each device takes when there are several (even, as
    placement splits the replica's GPU memory evenly). With `reserved_gb` (what placement
    reserved on its GPUs, all together), also the share of each device's memory that is (the
    smallest device's), for an engine that is told how much of a device to take (vLLM's
    --gpu-memory-utilization), so that two replicas can share a device."""
    known = {
        d["index"]: d
        for d in node_devices
        if isinstance(d, dict) and isinstance(d.get("index"), int)
    }
    uuids = {index: str(d.get("uuid") or "")[:100] for index, d in known.items()}
    split = [round(1 / len(devices), 6)] * len(devices) if len(devices) >= 2 else []
    order = {
        "devices": list(devices),
        "device_uuids": [uuids.get(i, "") for i in devices],
        "gpu_layers": spec.get("gpu_layers", 0) if devices else 0,
        "tensor_split": split,
    }
    totals = [known.get(i, {}).get("memory_total_mb") for i in devices]
    if devices and reserved_gb > 0 and all(isinstance(t, int) and t > 0 for t in totals):
        per_device_mb = reserved_gb * 1024 / len(devices)
        share = per_device_mb / min(t for t in totals if isinstance(t, int))
        order["gpu_memory_share"] = round(min(1.0, share), 4)
    return order


def weights_revision(
    source: str,
    sha256: str | None,
    mmproj: Mapping[str, Any] | None = None,
    files: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """A short name for the files a replica serves: the weights' checksum's start when known (a
    registry model always has one), else a digest of where they come from; with a vision
    projector (`mmproj`, as a spec holds it), a digest of that and the projector's checksum (or
    URL), so that a new projector alone is a new revision too. Replicas of one model on the same
    files share it whatever their profile, which is what the gateway counts a canary's figures
    by. A text model's revision is what it was before projectors. A snapshot's other files
    (`files`, as a spec holds them) are digested with the rest the same way."""
    weights = sha256[:12] if sha256 else hashlib.sha256(source.encode()).hexdigest()[:12]
    loaded = [mmproj] if mmproj and mmproj.get("source") else []
    loaded += [f for f in files or () if isinstance(f, Mapping) and f.get("source")]
    if not loaded:
        return weights
    text = "+".join([weights, *(str(f.get("sha256") or f["source"]) for f in loaded)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def model_revision(model: Model) -> str:
    """The revision of the files a model points at now (weights_revision)."""
    projector = model.projector
    return weights_revision(
        model.source,
        model.sha256 or None,
        projector.spec() if projector else None,
        [f.spec() for f in model.snapshot_files],
    )


def replica_revision(spec: dict[str, Any] | None) -> str:
    spec = spec or {}
    files = spec.get("files")
    return weights_revision(
        str(spec.get("source") or ""),
        spec.get("sha256"),
        spec.get("mmproj") or None,
        files if isinstance(files, list) else None,
    )


def spec_key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def current_keys(model: Model) -> dict[str, str]:
    """The spec key each of the model's profiles would start a replica with now."""
    return {p["name"]: spec_key(replica_spec(model, p)) for p in model.profiles}
