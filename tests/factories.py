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


def canary_record(**overrides: Any) -> dict[str, Any]:
    """A model's `canary` as registry.canary writes it: one watching, with figures."""
    record: dict[str, Any] = {
        "state": "watching",
        "rollout": None,
        "percent": 20,
        "revision": "bbbbbbbbbbbb",
        "from_revision": "aaaaaaaaaaaa",
        "from_commit": "a1b2c3d" + "0" * 33,
        "to_commit": "e4f5a6b" + "1" * 33,
        "window_seconds": 600,
        "max_error_rate": 0.05,
        "max_latency_ratio": 2.0,
        "asked_by": "alice",
        "started_at": "2026-12-03T00:10:00+00:00",
        "ends_at": "2026-12-03T00:20:00+00:00",
        "checks": 4,
        "checked_at": "2026-12-03T00:11:00+00:00",
        "figures": {
            "old": {"requests": 80, "errors": 0, "seconds": 16.0},
            "new": {"requests": 20, "errors": 1, "seconds": 5.0},
        },
        "verdict": "healthy so far: 1 server errors in 20 answers (5.0%)",
    }
    record.update(overrides)
    return record
