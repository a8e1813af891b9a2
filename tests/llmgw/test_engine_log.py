"""Rotating an engine's log: whoever sees ``engine.log.1`` sees it whole, and the log it came
from already emptied."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw import engine


def test_a_log_past_its_size_is_copied_whole_and_emptied(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"x" * 3000)
    (tmp_path / "engine.log.1").write_bytes(b"older")

    assert engine.rotate_log(log, 2000)

    assert log.stat().st_size == 0
    assert (tmp_path / "engine.log.1").read_bytes() == b"x" * 3000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.log", "engine.log.1"]


def test_a_log_under_its_size_is_left_alone(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"x" * 100)

    assert not engine.rotate_log(log, 2000)
    assert log.read_bytes() == b"x" * 100
    assert not (tmp_path / "engine.log.1").exists()


def test_the_rotated_log_appears_only_once_the_log_is_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"x" * 3000)
    seen_at_truncate: list[bool] = []
    real_truncate = os.truncate

    def truncate(path: Path, length: int) -> None:
        seen_at_truncate.append((tmp_path / "engine.log.1").exists())
        real_truncate(path, length)

    monkeypatch.setattr(engine.os, "truncate", truncate)

    assert engine.rotate_log(log, 2000)
    assert seen_at_truncate == [False]
    assert (tmp_path / "engine.log.1").stat().st_size == 3000


def test_a_failed_rotation_leaves_no_partial_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"x" * 3000)

    def truncate(path: Path, length: int) -> None:
        raise PermissionError("read-only")

    monkeypatch.setattr(engine.os, "truncate", truncate)

    assert not engine.rotate_log(log, 2000)
    assert log.stat().st_size == 3000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.log"]
