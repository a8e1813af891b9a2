"""Builders of valid test data."""

from __future__ import annotations

from typing import Any


def definition(name: str = "tiny-chat", **overrides: Any) -> dict[str, Any]:
    """A valid model definition, with overrides."""
    data: dict[str, Any] = {
        "name": name,
        "source": f"http://127.0.0.1:8000/mirror/acme/{name}/0123abc/{name}.gguf",
        "description": "a tiny test model",
        "min_replicas": 1,
        "profiles": [{"name": "cpu", "memory_gb": 1, "cores": 1}],
    }
    data.update(overrides)
    return data
