"""What the control plane asks for: its heartbeat answer, parsed and checked.

An answer this agent does not understand is refused whole (AnswerError), so that a bad
answer changes nothing rather than half of what runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

MAX_SLOTS = 256

_SHA256 = re.compile(r"[0-9a-f]{64}")
# A replica id becomes a folder name: no separators, no "." or "..".
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# An engine's key goes into a file and an HTTP header: letters, digits, "-" and "_" only.
_ENGINE_KEY = re.compile(r"[A-Za-z0-9_-]{16,128}")


class AnswerError(Exception):
    """The control plane's answer is not something this agent understands."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    source: str
    sha256: str | None
    scale: float


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
        }


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


def parse_answer(body: Any) -> Answer:
    """The wanted replicas, the heartbeat interval and the files to keep, from a 200 answer;
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
    return Answer(specs, interval, kept)
