"""The mirror serves its files with Range support, and nothing outside its root."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.django_db


@pytest.fixture
def mirror(tmp_path: Path, server_yaml: Any) -> Path:
    root = tmp_path / "mirror"
    (root / "acme" / "tiny" / "abc123").mkdir(parents=True)
    (root / "acme" / "tiny" / "abc123" / "w.gguf").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "secret.txt").write_text("no")
    server_yaml({"mirror": {"root": str(root)}})
    return root


def test_it_serves_whole_files_and_ranges(client: Any, mirror: Path) -> None:
    whole = client.get("/mirror/acme/tiny/abc123/w.gguf")
    assert whole.status_code == 200 and whole["Content-Length"] == "1024"
    assert b"".join(whole.streaming_content) == bytes(range(256)) * 4
    part = client.get("/mirror/acme/tiny/abc123/w.gguf", HTTP_RANGE="bytes=10-19")
    assert part.status_code == 206 and part["Content-Range"] == "bytes 10-19/1024"
    assert b"".join(part.streaming_content) == bytes(range(10, 20))
    tail = client.get("/mirror/acme/tiny/abc123/w.gguf", HTTP_RANGE="bytes=-4")
    assert b"".join(tail.streaming_content) == bytes([252, 253, 254, 255])
    head = client.head("/mirror/acme/tiny/abc123/w.gguf")
    assert (
        head.status_code == 200
        and head["Content-Length"] == "1024"
        and head["Accept-Ranges"] == "bytes"
    )
    assert (
        client.get("/mirror/acme/tiny/abc123/w.gguf", HTTP_RANGE="bytes=5000-").status_code == 416
    )


def test_it_refuses_paths_outside_its_root_and_missing_files(client: Any, mirror: Path) -> None:
    assert client.get("/mirror/../secret.txt").status_code == 404
    assert (
        client.get("/mirror/acme/tiny/abc123/%2e%2e/%2e%2e/%2e%2e/../secret.txt").status_code == 404
    )
    assert client.get("/mirror/acme/tiny/abc123/nope.gguf").status_code == 404
    assert client.post("/mirror/acme/tiny/abc123/w.gguf").status_code == 405
