"""What one replica reserves of a node's memory: the one rule placement, `model plan`, the
target page and every other door use.

A replica reserves the larger of what its profile declares (``memory_gb``, and
``gpu_memory_gb`` on each GPU) and the estimate from its model file's GGUF header, so that a
profile that raises ``slots`` without raising ``memory_gb`` cannot take memory its neighbours
were promised. The header is read once per model file and kept in :class:`~fleet.models.ModelFile`;
until it is read, the declared figures count. The rule for operators:
docs/nodes.md#what-placement-reserves.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from catalog.models import Model, Projector, projector_of, repository_file
from catalog.sources import check_source, source_session
from core.outbound import URLRefused
from core.refusals import Refused
from llmgw.engines import DEFAULT_ENGINE, get_engine
from llmgw.engines.base import WeightsUnreadable
from llmgw.units import format_bytes

from .models import ModelFile
from .specs import profile_gpu_layers, profile_slots

log = logging.getLogger("llmgw.footprint")

GIB = 1024**3
# A header that could not be read is asked for again after this long (or when the source
# changes): a source that is down should not slow every reconcile pass.
RETRY_AFTER = timedelta(minutes=5)
# A pass reads at most this many headers, each within the timeout, before it plans; the rest
# are read by the next passes (their replicas reserve the declared memory meanwhile).
READS_PER_PASS = 4
READ_TIMEOUT_SECONDS = 5.0
# A header read for a file no model uses (a `model plan` of a definition never added, a model
# since removed or moved to other files) is forgotten after this long.
FORGET_AFTER = timedelta(hours=1)
FORGOTTEN_PER_DELETE = 500


@dataclass(frozen=True)
class FileFacts:
    """What the memory estimate needs from a model file's header."""

    weights_bytes: int
    kv_bytes_per_token: int  # K and V of every layer for one position, f16
    trained_context: int | None
    block_count: int | None = None  # the model's layers


@dataclass(frozen=True)
class Estimate:
    """One replica's memory from its model file's header, for a given context and slot count."""

    weights_bytes: int
    kv_cache_bytes: int  # every slot's
    prompt_cache_bytes: int  # one slot's worth: the engine's store of earlier prompts
    context_length: int
    slots: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.prompt_cache_bytes

    def words(self) -> str:
        return (
            f"weights {format_bytes(self.weights_bytes)} + KV cache "
            f"{format_bytes(self.kv_cache_bytes)} for {self.slots} slot"
            f"{'' if self.slots == 1 else 's'} x {self.context_length} tokens + prompt cache "
            f"{format_bytes(self.prompt_cache_bytes)}"
        )


@dataclass(frozen=True)
class Footprint:
    """What one replica of a profile reserves of memory, and how that was decided.

    For a GPU profile (``gpus`` > 0), ``offloaded`` is the share of the model's layers on its
    GPUs (1.0 for "all"); the rest is in host memory."""

    profile: str
    declared_gb: float
    estimate: Estimate | None
    unknown: str = ""  # why there is no estimate
    gpus: int = 0
    declared_gpu_gb: float = 0.0  # the profile's gpu_memory_gb: per GPU
    gpu_layers: int | str = 0
    offloaded: float = 0.0

    @property
    def gpu_bytes(self) -> int:
        """The estimate's bytes on the GPUs, all of them together: the offloaded share of the
        weights and the slots' KV cache (the prompt cache stays in host memory)."""
        if self.estimate is None or not self.gpus:
            return 0
        on_layers = self.estimate.weights_bytes + self.estimate.kv_cache_bytes
        return int(on_layers * self.offloaded)

    @property
    def host_bytes(self) -> int:
        """The estimate's bytes in host memory: what is not offloaded."""
        if self.estimate is None:
            return 0
        return self.estimate.total_bytes - self.gpu_bytes

    @property
    def memory_gb(self) -> float:
        """The host memory reservation: the declared memory_gb, or the estimate when larger."""
        if self.estimate is None:
            return self.declared_gb
        return max(self.declared_gb, self.host_bytes / GIB)

    @property
    def gpu_memory_gb_per_gpu(self) -> float:
        """What each of its GPUs holds: the declared gpu_memory_gb, or the estimate's share."""
        if not self.gpus:
            return self.declared_gpu_gb
        return max(self.declared_gpu_gb, self.gpu_bytes / self.gpus / GIB)

    @property
    def gpu_memory_gb(self) -> float:
        """GPU memory over all its GPUs, as placement reserves it."""
        return self.gpu_memory_gb_per_gpu * self.gpus if self.gpus else self.declared_gpu_gb

    @property
    def above_declared(self) -> bool:
        return self.memory_gb > self.declared_gb

    @property
    def gpu_above_declared(self) -> bool:
        return bool(self.gpus) and self.gpu_memory_gb_per_gpu > self.declared_gpu_gb

    def note(self) -> str:
        """Words for a refusal when the estimate, not the declaration, set the reservation."""
        if self.estimate is None:
            return ""
        notes = []
        if self.above_declared:
            notes.append(
                f"profile {self.profile} reserves {format_bytes(self.host_bytes)} "
                f"({self.host_words()}), more than its memory_gb {self.declared_gb:g}"
            )
        if self.gpu_above_declared:
            notes.append(
                f"profile {self.profile} reserves {format_bytes(self.gpu_bytes // self.gpus)} "
                f"on each of its {self.gpus} GPU{'' if self.gpus == 1 else 's'} "
                f"({self.gpu_words()}), more than its gpu_memory_gb {self.declared_gpu_gb:g}"
            )
        if not notes:
            return ""
        return "; ".join(notes) + "; fewer slots or a shorter context_length need less"

    def host_words(self) -> str:
        assert self.estimate is not None
        if not self.gpu_bytes:
            return self.estimate.words()
        return f"{self.estimate.words()}, less {format_bytes(self.gpu_bytes)} on its GPUs"

    def gpu_words(self) -> str:
        assert self.estimate is not None
        layers = "every layer" if self.offloaded >= 1 else f"{self.gpu_layers} layers"
        return (
            f"{layers} of weights {format_bytes(self.estimate.weights_bytes)} + KV cache "
            f"{format_bytes(self.estimate.kv_cache_bytes)}, split over its GPUs"
        )


def offloaded_share(gpu_layers: int | str, block_count: int | None) -> float:
    """The share of a model's layers on its GPUs for a profile's gpu_layers: all of them when
    the layer count is unknown (the side a replica cannot borrow from)."""
    if not isinstance(gpu_layers, int) or not block_count:
        return 1.0
    return min(gpu_layers, block_count) / block_count


def footprint(
    profile: dict[str, Any],
    facts: FileFacts | str,
    *,
    context_length: int | None,
    engine_name: str = DEFAULT_ENGINE,
) -> Footprint:
    """What a replica of ``profile`` reserves, given its model file's facts (or why they are
    unknown) and the model's declared context_length.

    A replica's engine holds the weights and the KV cache its memory model says (the engine's
    serving_memory in llmgw.engines: for the default engine, a whole context for each of its
    slots and one more slot's worth for its prompt cache); the node sizes it the same way. A
    declared figure above the estimate is kept: it may count what the estimate does not
    (compute buffers, a tokenizer, headroom).

    A GPU profile's engine holds the layers it offloads (``gpu_layers``: "all", or a count of
    the model's layers, taken as a share of the header's block_count): that share of the
    weights and of the slots' KV cache, split evenly over its GPUs (``--split-mode layer``). The
    rest, and the prompt cache (``--cache-ram``), stay in host memory. So it reserves on each
    GPU the larger of ``gpu_memory_gb`` and its share, and in host memory the larger of
    ``memory_gb`` and what is left."""
    declared = float(profile["memory_gb"])
    gpus = int(profile.get("gpus") or 0)
    declared_gpu = float(profile.get("gpu_memory_gb") or 0)
    layers = profile_gpu_layers(profile)
    if isinstance(facts, str):
        return Footprint(profile["name"], declared, None, facts, gpus, declared_gpu, layers)
    slots = profile_slots(profile)
    engine = get_engine(engine_name)
    context = engine.serving_context(context_length, facts.trained_context)
    memory = engine.serving_memory(
        weights_bytes=facts.weights_bytes,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        context_length=context,
        slots=slots,
    )
    estimate = Estimate(
        weights_bytes=memory.weights_bytes,
        kv_cache_bytes=memory.kv_cache_bytes,
        prompt_cache_bytes=memory.prompt_cache_bytes,
        context_length=context,
        slots=slots,
    )
    offloaded = offloaded_share(layers, facts.block_count) if gpus else 0.0
    return Footprint(profile["name"], declared, estimate, "", gpus, declared_gpu, layers, offloaded)


def model_footprints(model: Model, facts: FileFacts | str) -> list[Footprint]:
    """Every profile's footprint, in the model's profile order."""
    return [
        footprint(p, facts, context_length=model.context_length, engine_name=model.engine_name)
        for p in model.profiles
    ]


# -- the model files' facts -------------------------------------------------------------


# What file_key reads of a model beyond source and sha256: a read of models for their footprint
# (fleet.selectors.unplaceable_models) loads these too, or each would be loaded row by row.
FILE_FIELDS = ("mmproj", "origin", "engine", "files")


def file_key(model: Model) -> str:
    """A model file is its source and, when known, its sha256 (a URL may serve new bytes); with
    a vision projector or a snapshot's other files, theirs too (their bytes count with the
    weights')."""
    return _key(model.source, model.sha256, model.projector, model.snapshot_files)


def _key(
    source: str,
    sha256: str | None,
    projector: Projector | None = None,
    files: tuple[Projector, ...] = (),
) -> str:
    text = f"{source}\0{sha256 or ''}"
    for loaded in (projector, *files):
        if loaded is not None:
            text += f"\0{loaded.source}\0{loaded.sha256 or ''}"
    return hashlib.sha256(text.encode()).hexdigest()


NOT_READ = "its GGUF header has not been read yet"


def known_facts(models: Iterable[Model]) -> dict[str, FileFacts | str]:
    """Per model name: its file's facts, or why they are not known; one query."""
    models = list(models)
    rows = {row.key: row for row in ModelFile.objects.filter(key__in=[file_key(m) for m in models])}
    found: dict[str, FileFacts | str] = {}
    for model in models:
        row = rows.get(file_key(model))
        found[model.name] = NOT_READ if row is None else _facts_of(row)
    return found


def _facts_of(row: ModelFile) -> FileFacts | str:
    if row.error or row.weights_bytes is None or row.kv_bytes_per_token is None:
        return row.error or "its GGUF header could not be read"
    return FileFacts(
        row.weights_bytes, row.kv_bytes_per_token, row.trained_context, row.block_count
    )


def learn_facts(models: Iterable[Model], *, now: datetime | None = None) -> int:
    """Read the headers of model files not known yet (or that failed a while ago), at most
    READS_PER_PASS of them, over HTTP Range requests; the number read. A reconcile pass calls it
    before it plans. Runs outside any transaction: it waits on HTTP."""
    now = now or timezone.now()
    models = [m for m in models if m.source]
    keys = {file_key(m): m for m in models}
    rows = {row.key: row for row in ModelFile.objects.filter(key__in=list(keys))}
    due = [
        model
        for key, model in sorted(keys.items(), key=lambda kv: kv[1].name)
        if key not in rows or (rows[key].error and rows[key].read_at < now - RETRY_AFTER)
    ]
    for model in due[:READS_PER_PASS]:
        read_facts(model, now=now)
    return min(len(due), READS_PER_PASS)


def forget_unused(models: Iterable[Model], *, now: datetime | None = None) -> int:
    """Drop what was read about files that no model uses now or would go back to (its previous
    files), once older than FORGET_AFTER; the number dropped. Anyone may ask for a plan of any
    definition, so without this the table would grow with every one. Beat runs it
    (fleet.tasks.forget_unused_files); the difference is taken here, not in an SQL NOT IN of
    every model's key, which a large catalog would push past SQLite's parameter limit."""
    now = now or timezone.now()
    kept = set()
    for model in models:
        kept.add(file_key(model))
        previous = model.previous or {}
        if previous.get("source"):
            origin = previous.get("origin")
            projector = projector_of(previous["source"], model.mmproj, origin)
            files = tuple(repository_file(previous["source"], p, origin) for p in model.files)
            kept.add(_key(previous["source"], previous.get("sha256", ""), projector, files))
    old = ModelFile.objects.filter(read_at__lt=now - FORGET_AFTER).values_list("pk", "key")
    unused = [pk for pk, key in old.iterator() if key not in kept]
    for start in range(0, len(unused), FORGOTTEN_PER_DELETE):
        ModelFile.objects.filter(pk__in=unused[start : start + FORGOTTEN_PER_DELETE]).delete()
    return len(unused)


def facts_for_plan(model: Model) -> FileFacts | str:
    """The facts ``model plan`` shows: known ones, else read now (and kept for placement)."""
    known = known_facts([model])[model.name]
    if isinstance(known, FileFacts):
        return known
    return read_facts(model)


def read_facts(model: Model, *, now: datetime | None = None) -> FileFacts | str:
    """Read ``model``'s weights' facts now (its engine says how: a GGUF header, a snapshot's
    config) and keep what the estimate needs (or why it failed)."""
    engine = get_engine(model.engine_name)
    try:
        # The engine loads the vision projector and a snapshot's other files beside the
        # weights: their bytes are held as the weights' are (in host memory, or on the GPUs
        # with the offloaded layers).
        loaded_with = _loaded_with_bytes(model)
        with source_session() as session:
            read = engine.read_facts(
                model.source, session=session, timeout=READ_TIMEOUT_SECONDS, loaded_with=loaded_with
            )
        facts: FileFacts | str = FileFacts(
            read.weights_bytes, read.kv_bytes_per_token, read.trained_context, read.block_count
        )
    except WeightsUnreadable as exc:
        facts = exc.__cause__.message if isinstance(exc.__cause__, URLRefused) else str(exc)
        log.info("memory of %s not estimated: %s", model.name, facts)
    except Refused as exc:
        facts = exc.message
        log.info("memory of %s not estimated: %s", model.name, facts)
    ModelFile.objects.update_or_create(
        key=file_key(model),
        defaults={
            "source": model.source,
            "weights_bytes": facts.weights_bytes if isinstance(facts, FileFacts) else None,
            "kv_bytes_per_token": facts.kv_bytes_per_token
            if isinstance(facts, FileFacts)
            else None,
            "trained_context": facts.trained_context if isinstance(facts, FileFacts) else None,
            "block_count": facts.block_count if isinstance(facts, FileFacts) else None,
            "error": facts if isinstance(facts, str) else "",
            "read_at": now or timezone.now(),
        },
    )
    return facts


def _loaded_with_bytes(model: Model) -> int:
    """The bytes of the files loaded beside the weights: the vision projector's (0 without
    one) and a snapshot's other files'; Refused naming the file whose size is not known."""
    total = 0
    projector = model.projector
    named = [(projector, "projector", "its vision projector")] if projector else []
    named += [(f, "file", f"its file {f.path!r}") for f in model.snapshot_files]
    for loaded, kind, what in named:
        try:
            total += _size_of(loaded, kind)
        except Refused as exc:
            raise Refused(f"{what}: {exc.message}", code=exc.code) from None
    return total


def _size_of(loaded: Projector, kind: str) -> int:
    """A file's size: the registry's record of it, else what its URL says
    (catalog.sources.check_source, which refuses when it is not there)."""
    if loaded.size is not None:
        return loaded.size
    size = check_source(loaded.source, what=f"{kind} {loaded.path!r}").size
    if size is None:
        raise Refused(f"{loaded.source} did not say how large it is", code="source_size")
    return size
