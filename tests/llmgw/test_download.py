"""llmgw.download: a file is kept only once it is whole and its digest is the one expected."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any, TypeVar

import pytest

from llmgw.download import BadStatus, WrongDigest, WrongSize, download_verified
from tests.support.http_files import serve_directory

Refusal = TypeVar("Refusal", bound=Exception)

CONTENT = os.urandom(3 * (1 << 20) + 123)  # more than one chunk, not a whole number of them


@pytest.fixture
def served(tmp_path: Path) -> Path:
    folder = tmp_path / "served"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(CONTENT)
    (folder / "README.md").write_bytes(b"# a small plain file\n")
    return folder


@pytest.fixture
def into(tmp_path: Path) -> Path:
    folder = tmp_path / "tmp"
    folder.mkdir()
    return folder


def test_it_places_a_verified_file_and_leaves_nothing_behind(served: Path, into: Path) -> None:
    target = into.parent / "kept.gguf"
    seen: list[tuple[int, int | None]] = []
    with serve_directory(served) as (base, _):
        size, digest = download_verified(
            f"{base}/model.gguf",
            into=into,
            place=lambda partial, _digest: partial.rename(target),
            timeout=(5, 10),
            expected_digest=hashlib.sha256(CONTENT).hexdigest(),
            progress=lambda done, total: seen.append((done, total)),
        )
    assert (size, digest) == (len(CONTENT), hashlib.sha256(CONTENT).hexdigest())
    assert target.read_bytes() == CONTENT
    assert list(into.iterdir()) == []
    # From nothing to all of it, against the Content-Length the server sent.
    assert seen[0] == (0, len(CONTENT)) and seen[-1] == (len(CONTENT), len(CONTENT))


def refused(url: str, into: Path, error: type[Refusal], **checks: Any) -> Refusal:
    """Download ``url`` with ``checks``: it must raise ``error``, and nothing may be kept."""

    def placed(partial: Path, _digest: str) -> None:
        pytest.fail(f"a refused download was placed ({partial})")

    with pytest.raises(error) as raised:
        download_verified(url, into=into, place=placed, timeout=(5, 10), **checks)
    assert list(into.iterdir()) == []
    return raised.value


def test_it_keeps_nothing_when_the_digest_differs(served: Path, into: Path) -> None:
    with serve_directory(served) as (base, _):
        wrong = refused(f"{base}/model.gguf", into, WrongDigest, expected_digest="0" * 64)
    assert (wrong.digest, wrong.expected) == (hashlib.sha256(CONTENT).hexdigest(), "0" * 64)


def test_it_keeps_nothing_when_the_size_differs(served: Path, into: Path) -> None:
    with serve_directory(served) as (base, _):
        short = refused(f"{base}/model.gguf", into, WrongSize, expected_size=len(CONTENT) + 1)
    assert (short.size, short.expected) == (len(CONTENT), len(CONTENT) + 1)


def test_it_refuses_an_answer_other_than_200(served: Path, into: Path) -> None:
    with serve_directory(served) as (base, _):
        assert refused(f"{base}/missing.gguf", into, BadStatus).status == 404


def test_a_progress_callback_that_raises_stops_it_and_keeps_nothing(
    served: Path, into: Path
) -> None:
    class Stop(Exception):
        pass

    def stop_after_the_first_chunk(done: int, _total: int | None) -> None:
        if done > 0:
            raise Stop

    with serve_directory(served) as (base, _):
        refused(f"{base}/model.gguf", into, Stop, progress=stop_after_the_first_chunk)


def test_a_prefix_and_algorithm_check_a_git_blob_id(served: Path, into: Path) -> None:
    plain = served / "README.md"
    blob_id = subprocess.run(
        ["git", "hash-object", str(plain)], capture_output=True, text=True, check=True
    ).stdout.strip()
    size = plain.stat().st_size
    with serve_directory(served) as (base, _):
        _, digest = download_verified(
            f"{base}/README.md",
            into=into,
            name=".README.md.",
            place=lambda partial, _digest: partial.rename(into.parent / "README.md"),
            timeout=(5, 10),
            algorithm="sha1",
            prefix=f"blob {size}\0".encode(),
            expected_digest=blob_id,
            expected_size=size,
        )
    assert digest == blob_id
    assert (into.parent / "README.md").read_bytes() == plain.read_bytes()
