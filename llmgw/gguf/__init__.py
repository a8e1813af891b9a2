"""GGUF files: the header (llmgw.gguf.header), read from a URL without the weights
(llmgw.gguf.remote), the LoRA adapter rules (llmgw.gguf.lora) and the memory estimate
(llmgw.gguf.memory).

This package must not import Django: the node agent uses it too. The names below are the
package's whole public surface, so a caller writes ``from llmgw import gguf`` and
``gguf.read_header_from_url(...)`` without knowing which module holds what.
"""

from __future__ import annotations

from .header import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    MAX_HEADER_BYTES,
    SHORT_ARRAY_LIMIT,
    SUPPORTED_VERSIONS,
    GGUFArray,
    GGUFError,
    GGUFHeader,
    HeaderTooLargeError,
    NeedMoreData,
    NotGGUFError,
    TensorInfo,
    TruncatedGGUFError,
    ValueType,
    parse_header,
    read_header_from_file,
)
from .lora import adapter_problems
from .memory import (
    KV_BYTES_PER_VALUE,
    MemoryEstimate,
    estimate_memory_bytes,
    kv_bytes_per_token,
    serving_memory,
)
from .remote import FetchError, read_header_from_url

__all__ = [
    "DEFAULT_ALIGNMENT",
    "GGUF_MAGIC",
    "KV_BYTES_PER_VALUE",
    "MAX_HEADER_BYTES",
    "SHORT_ARRAY_LIMIT",
    "SUPPORTED_VERSIONS",
    "FetchError",
    "GGUFArray",
    "GGUFError",
    "GGUFHeader",
    "HeaderTooLargeError",
    "MemoryEstimate",
    "NeedMoreData",
    "NotGGUFError",
    "TensorInfo",
    "TruncatedGGUFError",
    "ValueType",
    "adapter_problems",
    "estimate_memory_bytes",
    "kv_bytes_per_token",
    "parse_header",
    "read_header_from_file",
    "read_header_from_url",
    "serving_memory",
]
