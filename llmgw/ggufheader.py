"""The old name of llmgw.gguf, kept only for llmgw.node.replica and bench/routing.py until
they import the package (files other people own). New code imports llmgw.gguf."""

from __future__ import annotations

from llmgw.gguf import GGUFError, adapter_problems, estimate_memory_bytes, read_header_from_file

__all__ = ["GGUFError", "adapter_problems", "estimate_memory_bytes", "read_header_from_file"]
