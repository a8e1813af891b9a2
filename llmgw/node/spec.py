"""What the control plane asks for: its heartbeat answer, parsed and checked.

An answer this agent does not understand is refused whole (AnswerError), so that a bad
answer changes nothing rather than half of what runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from llmgw.engines import DEFAULT_ENGINE, engine_names

MAX_SLOTS = 256
MAX_DEVICES = 64  # devices per node, as the heartbeat reports them
MAX_GPU_LAYERS = 100_000
MAX_SPLIT = 1_000_000.0

_SHA256 = re.compile(r"[0-9a-f]{64}")
# A replica id becomes a folder name: no separators, no "." or "..".
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# An engine's key goes into a file and an HTTP header: letters, digits, "-" and "_" only.
_ENGINE_KEY = re.compile(r"[A-Za-z0-9_-]{16,128}")
# A snapshot file's path in its repository becomes a path under the replica's folder: names of
# letters, digits, '.', '_' and '-' (not starting with '.'), folders separated by '/'.
_FILE_PATH = re.compile(
    r"(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,199}/){0,8}[A-Za-z0-9_][A-Za-z0-9._-]{0,199}"
)
MAX_FILES = 256
# A GPU's UUID goes into the engine's CUDA_VISIBLE_DEVICES ("GPU-1c2e...", "MIG-..."): no commas.
_DEVICE_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_/-]{0,99}")


class AnswerError(Exception):
    """The control plane's answer is not something this agent understands."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    source: str
    sha256: str | None
    scale: float


@dataclass(frozen=True)
class ProjectorSpec:
    """A model's vision projector, of its weights' revision (llama-server's --mmproj)."""

    source: str
    sha256: str | None


@dataclass(frozen=True)
class FileSpec:
    """One of a snapshot's other files: its path in the repository (and the snapshot's folder),
    at the weights' revision."""

    path: str
    source: str
    sha256: str | None


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica as the control plane describes it; an id never changes its spec."""

    id: str
    model: str
    source: str
    sha256: str | None
    adapters: tuple[AdapterSpec, ...]
    context_length: int | None
    threads: int | None
    slots: int = 1  # requests the engine serves at once
    # The key the engine is started with (never written with the spec: see Replica.key).
    engine_key: str | None = field(default=None, compare=False, repr=False)
    # The GPUs the control plane placed it on (empty: a CPU replica): the node's device
    # indices, their UUIDs ("" when unknown), the layers to offload ("all" or a number; 0 for
    # a CPU replica) and, over 2+ devices, each one's share of the layers.
    devices: tuple[int, ...] = ()
    device_uuids: tuple[str, ...] = ()
    gpu_layers: int | str = 0
    tensor_split: tuple[float, ...] = ()
    # The share of each of its devices' memory placement reserved for it (0 < share <= 1), for
    # an engine told how much of a device to take; None when not given.
    gpu_memory_share: float | None = None
    mmproj: ProjectorSpec | None = None
    # Its engine ranks documents (--reranking) instead of computing embeddings.
    reranking: bool = False
    # The engine it runs (llmgw.engines), and, for one that loads a snapshot, the snapshot's
    # files besides the source (its config.json).
    engine: str = DEFAULT_ENGINE
    files: tuple[FileSpec, ...] = ()

    @property
    def on_gpus(self) -> bool:
        """Whether its engine is started on GPUs (it has devices and offloads layers)."""
        return bool(self.devices) and self.gpu_layers != 0

    @classmethod
    def from_json(cls, data: Any) -> ReplicaSpec:
        if not isinstance(data, dict):
            raise AnswerError(f"a replica is {type(data).__name__}, not an object")
        replica_id = data.get("id")
        if not isinstance(replica_id, str) or not _REPLICA_ID.fullmatch(replica_id):
            raise AnswerError(f"a replica's id is {replica_id!r}, not a usable id")
        where = f"replica {replica_id}"
        adapters = data.get("adapters") or []
        if not isinstance(adapters, list):
            raise AnswerError(f"{where}: adapters is not a list")
        return cls(
            id=replica_id,
            model=_text(data, "model", where),
            source=_text(data, "source", where),
            sha256=_sha256(data.get("sha256"), where),
            adapters=tuple(_adapter(item, where) for item in adapters),
            context_length=_positive_int(data.get("context_length"), "context_length", where),
            # 0 threads means "no cores reserved": the engine's own default applies.
            threads=_positive_int(data.get("threads"), "threads", where) or None,
            slots=min(_positive_int(data.get("slots"), "slots", where) or 1, MAX_SLOTS),
            engine_key=_engine_key(data.get("engine_key"), where),
            mmproj=_projector(data.get("mmproj"), where),
            reranking=_flag(data.get("reranking"), "reranking", where),
            engine=_engine(data.get("engine"), where),
            files=_files(data.get("files"), where),
            **_gpus(data, where),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "source": self.source,
            "sha256": self.sha256,
            "adapters": [
                {"name": a.name, "source": a.source, "sha256": a.sha256, "scale": a.scale}
                for a in self.adapters
            ],
            "context_length": self.context_length,
            "threads": self.threads,
            "slots": self.slots,
            "devices": list(self.devices),
            "device_uuids": list(self.device_uuids),
            "gpu_layers": self.gpu_layers,
            "tensor_split": list(self.tensor_split),
            **(
                {"gpu_memory_share": self.gpu_memory_share}
                if self.gpu_memory_share is not None
                else {}
            ),
            **(
                {"mmproj": {"source": self.mmproj.source, "sha256": self.mmproj.sha256}}
                if self.mmproj
                else {}
            ),
            **({"reranking": True} if self.reranking else {}),
            **({"engine": self.engine} if self.engine != DEFAULT_ENGINE else {}),
            **(
                {
                    "files": [
                        {"path": f.path, "source": f.source, "sha256": f.sha256} for f in self.files
                    ]
                }
                if self.files
                else {}
            ),
        }


def _flag(value: Any, key: str, where: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise AnswerError(f"{where}: {key} is {value!r}, not true or false")
    return value


def _text(data: dict[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise AnswerError(f"{where}: {key} is {value!r}, not a non-empty string")
    return value


def _engine_key(value: Any, where: str) -> str | None:
    if value is None:
        return None  # a control plane from before engine keys: the engine runs without one
    if not isinstance(value, str) or not _ENGINE_KEY.fullmatch(value):
        raise AnswerError(f"{where}: engine_key is not 16-128 letters, digits, '-' or '_'")
    return value


def _sha256(value: Any, where: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not _SHA256.fullmatch(value.lower()):
        raise AnswerError(f"{where}: {value!r} is not a sha256 (64 hex digits)")
    return value.lower()


def _positive_int(value: Any, key: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AnswerError(f"{where}: {key} is {value!r}, not a whole number >= 0")
    return value


def _gpus(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The GPU fields of a replica, checked together: a control plane from before GPUs sends
    none of them, which is a CPU replica."""
    devices = _devices(data, where)
    uuids = _device_uuids(data, devices, where)
    layers = _gpu_layers(data, devices, where)
    split = _tensor_split(data, devices, where)
    return {
        "devices": tuple(devices),
        "device_uuids": tuple(uuids),
        "gpu_layers": layers,
        "tensor_split": tuple(float(share) for share in split),
        "gpu_memory_share": _share(data.get("gpu_memory_share"), devices, where),
    }


def _share(value: Any, devices: list[int], where: str) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= 1
        or not devices
    ):
        raise AnswerError(
            f"{where}: gpu_memory_share is {value!r}, not a share above 0 and at most 1 of the "
            "replica's devices"
        )
    return float(value)


def _devices(data: dict[str, Any], where: str) -> list[int]:
    devices = data.get("devices") or []
    if not isinstance(devices, list) or len(devices) > MAX_DEVICES:
        raise AnswerError(f"{where}: devices is not a list of at most {MAX_DEVICES} indices")
    for index in devices:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_DEVICES:
            raise AnswerError(
                f"{where}: a device index is {index!r}, not a whole number 0-{MAX_DEVICES - 1}"
            )
    if len(set(devices)) != len(devices):
        raise AnswerError(f"{where}: devices lists one device twice")
    return devices


def _device_uuids(data: dict[str, Any], devices: list[int], where: str) -> list[str]:
    uuids = data.get("device_uuids") or []
    if not isinstance(uuids, list) or (uuids and len(uuids) != len(devices)):
        raise AnswerError(f"{where}: device_uuids is not a list with one entry per device")
    for uuid in uuids:
        if not isinstance(uuid, str) or (uuid and not _DEVICE_UUID.fullmatch(uuid)):
            raise AnswerError(f"{where}: a device uuid is {str(uuid)[:120]!r}, not a GPU's UUID")
    return uuids


def _gpu_layers(data: dict[str, Any], devices: list[int], where: str) -> int | str:
    """The layers to offload: "all" or a number, "all" when devices are given without it."""
    layers = data.get("gpu_layers")
    if layers is None:
        layers = "all" if devices else 0
    if layers != "all" and (
        isinstance(layers, bool) or not isinstance(layers, int) or not 0 <= layers <= MAX_GPU_LAYERS
    ):
        raise AnswerError(
            f'{where}: gpu_layers is {layers!r}, not "all" or a whole number 0-{MAX_GPU_LAYERS}'
        )
    if layers != 0 and not devices:
        raise AnswerError(f"{where}: gpu_layers is {layers!r} but no devices are given")
    return layers


def _tensor_split(data: dict[str, Any], devices: list[int], where: str) -> list[int | float]:
    """Each device's share of the layers, over 2 or more devices; empty when none is given."""
    split = data.get("tensor_split") or []
    if not isinstance(split, list):
        raise AnswerError(f"{where}: tensor_split is not a list")
    if not split:
        return split
    if len(devices) < 2 or len(split) != len(devices):
        raise AnswerError(
            f"{where}: tensor_split has {len(split)} entries for {len(devices)} devices "
            "(one per device, over 2 or more)"
        )
    for share in split:
        if (
            isinstance(share, bool)
            or not isinstance(share, int | float)
            or not 0 <= share <= MAX_SPLIT
        ):
            raise AnswerError(f"{where}: a tensor_split share is {share!r}, not 0-{MAX_SPLIT:g}")
    if sum(split) <= 0:
        raise AnswerError(f"{where}: tensor_split gives the devices no share of the layers")
    return split


def _engine(value: Any, where: str) -> str:
    if value is None:
        return DEFAULT_ENGINE  # a control plane from before engines, or the default one
    if value not in engine_names():
        raise AnswerError(
            f"{where}: engine is {str(value)[:60]!r}, not one this agent runs "
            f"({', '.join(engine_names())})"
        )
    return str(value)


def _files(data: Any, where: str) -> tuple[FileSpec, ...]:
    if data is None:
        return ()
    if not isinstance(data, list) or len(data) > MAX_FILES:
        raise AnswerError(f"{where}: files is not a list of at most {MAX_FILES}")
    files = []
    for item in data:
        if not isinstance(item, dict):
            raise AnswerError(f"{where}: a file is {type(item).__name__}, not an object")
        path = item.get("path")
        if (
            not isinstance(path, str)
            or not _FILE_PATH.fullmatch(path)
            or any(part in (".", "..") for part in path.split("/"))
        ):
            raise AnswerError(f"{where}: a file's path is {str(path)[:120]!r}, not a usable one")
        files.append(
            FileSpec(
                path=path,
                source=_text(item, "source", f"{where}, file {path}"),
                sha256=_sha256(item.get("sha256"), f"{where}, file {path}"),
            )
        )
    if len({f.path for f in files}) != len(files):
        raise AnswerError(f"{where}: files names one path twice")
    return tuple(files)


def _projector(data: Any, where: str) -> ProjectorSpec | None:
    if data is None:
        return None  # a text model, or a control plane from before projectors
    if not isinstance(data, dict):
        raise AnswerError(f"{where}: mmproj is {type(data).__name__}, not an object")
    return ProjectorSpec(
        source=_text(data, "source", f"{where}, mmproj"),
        sha256=_sha256(data.get("sha256"), f"{where}, mmproj"),
    )


def _adapter(data: Any, where: str) -> AdapterSpec:
    if not isinstance(data, dict):
        raise AnswerError(f"{where}: an adapter is {type(data).__name__}, not an object")
    scale = data.get("scale", 1.0)
    if scale is None:
        scale = 1.0
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise AnswerError(f"{where}: an adapter's scale is {scale!r}, not a number")
    name = _text(data, "name", where)
    return AdapterSpec(
        name=name,
        source=_text(data, "source", f"{where}, adapter {name}"),
        sha256=_sha256(data.get("sha256"), f"{where}, adapter {name}"),
        scale=float(scale),
    )


@dataclass(frozen=True)
class Answer:
    replicas: list[ReplicaSpec]
    interval: float | None
    # Files to keep in the cache though no replica here uses them now: the previous revisions
    # of the models this node runs, which a rollback would start again. (source, sha256)
    keep: tuple[tuple[str, str | None], ...] = ()
    # The version of what to run this answer holds (None: not one a renewal may name).
    generation: int | None = None


def parse_answer(body: Any) -> Answer:
    """The wanted replicas, the heartbeat interval, the files to keep and the generation, from a
    200 answer (a heartbeat's, or a renewal's that changed);
    AnswerError if the answer is malformed anywhere (then nothing changes: a half-understood
    answer must not stop replicas)."""
    if not isinstance(body, dict):
        raise AnswerError(f"the answer is {type(body).__name__}, not an object")
    replicas = body.get("replicas")
    if not isinstance(replicas, list):
        raise AnswerError("the answer has no list of replicas")
    specs = [ReplicaSpec.from_json(item) for item in replicas]
    ids = [spec.id for spec in specs]
    if len(set(ids)) != len(ids):
        raise AnswerError("the answer lists one replica id twice")
    interval = body.get("heartbeat_interval")
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
        interval = None
    keep = body.get("keep") or []
    if not isinstance(keep, list):
        raise AnswerError("the answer's keep is not a list")
    kept = tuple(
        (_text(item, "source", "a kept file"), _sha256(item.get("sha256"), "a kept file"))
        for item in keep
        if isinstance(item, dict)
    )
    generation = body.get("generation")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        generation = None
    return Answer(specs, interval, kept, generation)
