"""The engines a replica can run, each a backend of the contract in llmgw.engines.base.

As Django names a database backend by a dotted path, ENGINES maps an engine's name (what a
model definition and a node's report say) to its backend class. Adding an engine is one more
module here and one more line in ENGINES (docs/design.md#the-engine-contract). No Django.
"""

from __future__ import annotations

import functools
import importlib

from .base import Engine, EngineSettings, Features

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "Engine",
    "EngineSettings",
    "Features",
    "UnknownEngine",
    "engine_names",
    "get_engine",
]

DEFAULT_ENGINE = "llama.cpp"
ENGINES: dict[str, str] = {
    "llama.cpp": "llmgw.engines.llamacpp.LlamaServer",
    "vllm": "llmgw.engines.vllm.VLLM",
}


class UnknownEngine(LookupError):
    """No backend has this name."""


def engine_names() -> tuple[str, ...]:
    return tuple(ENGINES)


def get_engine(name: str = DEFAULT_ENGINE) -> Engine:
    """The backend of the engine called ``name``; UnknownEngine when there is none."""
    return _backend(name)


@functools.cache
def _backend(name: str) -> Engine:
    # One instance per engine and process: a backend holds no state, only what the engine is.
    try:
        dotted = ENGINES[name]
    except KeyError:
        raise UnknownEngine(
            f"there is no engine called {name!r}: the engines are {', '.join(ENGINES)}"
        ) from None
    module, _, attribute = dotted.rpartition(".")
    backend: type[Engine] = getattr(importlib.import_module(module), attribute)
    return backend()
