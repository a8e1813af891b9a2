"""Fixtures for the registry's tests: olah serving a git-lfs repository of tiny GGUF models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.actor import Actor
from llmgw.tinygguf import write_tiny_model
from tests.registry.serving import REPO
from tests.support.registry import LocalRegistry


@pytest.fixture
def weights(tmp_path: Path) -> dict[int, Path]:
    paths = {}
    for seed in (1, 2):
        paths[seed] = tmp_path / f"weights-{seed}.gguf"
        write_tiny_model(paths[seed], seed=seed)
    return paths


@pytest.fixture
def registry(tmp_path: Path, server_yaml: Any, weights: dict[int, Path]) -> Iterator[LocalRegistry]:
    with LocalRegistry(tmp_path / "registry") as running:
        running.first_commit = running.commit(REPO, {"tiny-chat-q4.gguf": weights[1]})  # type: ignore[attr-defined]
        server_yaml(
            {
                "registry": {"endpoint": running.endpoint},
                "mirror": {"root": str(tmp_path / "mirror")},
            }
        )
        yield running


@pytest.fixture
def alice(users: dict[str, Any]) -> Actor:
    return Actor.for_user(users["alice"], "cli")
