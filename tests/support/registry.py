"""A Hugging Face-compatible registry for tests: olah serving local git + git-lfs repositories.

    with LocalRegistry(tmp_path) as registry:
        commit = registry.commit("acme/tiny", {"tiny.gguf": path_or_bytes})
        registry.endpoint  # http://127.0.0.1:PORT, for huggingface_hub and server.yaml

It is the same local hub the run command serves its demo registry with (llmgw.localhub);
olah listens on 127.0.0.1 and is stopped by its pid when the block exits.
"""

from __future__ import annotations

from llmgw.localhub import LocalHub as LocalRegistry
from llmgw.localhub import unavailable as available

__all__ = ["LocalRegistry", "available"]
