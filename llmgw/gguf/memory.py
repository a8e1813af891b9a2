"""How much memory serving a GGUF model takes: the arithmetic, from the header or its facts.

One rule for every door: the node checks its reservation with it before starting an engine
(llmgw.node.replica), and placement reserves by it (fleet.footprint keeps each file's facts in
the database, so a reconcile pass does not read headers again). Compute buffers are not
included.
"""

from __future__ import annotations

from dataclasses import dataclass

from .header import GGUFError, GGUFHeader

KV_BYTES_PER_VALUE = 2  # llama.cpp's default KV cache type is f16


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_cache_bytes: int  # every slot's
    total_bytes: int
    prompt_cache_bytes: int = 0  # the engine's RAM store of earlier prompts (one slot's worth)


def serving_memory(
    *, weights_bytes: int, kv_bytes_per_token: int, context_length: int, slots: int
) -> MemoryEstimate:
    """The weights, a KV cache of ``context_length`` tokens for each of ``slots`` requests
    served at once, and one slot's worth more for the engine's store of earlier prompts (the
    node starts it so: llmgw.engine)."""
    one_slot = kv_bytes_per_token * context_length
    kv_cache = one_slot * max(1, slots)
    return MemoryEstimate(
        weights_bytes=weights_bytes,
        kv_cache_bytes=kv_cache,
        total_bytes=weights_bytes + kv_cache + one_slot,
        prompt_cache_bytes=one_slot,
    )


def kv_bytes_per_token(header: GGUFHeader) -> int:
    """K and V of every layer for one position, f16: block_count x head_count_kv x
    (key_length + value_length) x 2 bytes, where a head's length is embedding_length /
    head_count unless the header states key_length / value_length."""
    return _kv_bytes_per_token(header, context_length=1)


def estimate_memory_bytes(
    header: GGUFHeader, *, file_size: int, context_length: int | None = None, slots: int = 1
) -> MemoryEstimate:
    """Roughly how much memory serving this model takes (serving_memory): the weights are
    about the file size (the header is negligible next to the tensor data), the context is the
    header's unless given."""
    context = context_length if context_length is not None else header.context_length
    per_token = _kv_bytes_per_token(header, context_length=context)
    assert context
    return serving_memory(
        weights_bytes=file_size, kv_bytes_per_token=per_token, context_length=context, slots=slots
    )


def _kv_bytes_per_token(header: GGUFHeader, *, context_length: int | None) -> int:
    # The context is checked here too, so that one refusal names everything the header lacks.
    dims = {
        "block_count": header.block_count,
        "embedding_length": header.embedding_length,
        "attention.head_count": header.head_count,
        "context_length": context_length,
    }
    missing = [key for key, value in dims.items() if not value]
    if missing:
        names = ", ".join(f"{header.architecture}.{key}" for key in missing)
        raise GGUFError(f"Cannot estimate the memory of this model: its header lacks {names}.")
    assert header.block_count and header.embedding_length and header.head_count
    head_count_kv = header.head_count_kv or header.head_count
    default_head_dim = header.embedding_length // header.head_count
    key_dim = header.key_length or default_head_dim
    value_dim = header.value_length or default_head_dim
    return header.block_count * head_count_kv * (key_dim + value_dim) * KV_BYTES_PER_VALUE
