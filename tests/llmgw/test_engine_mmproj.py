"""A model with a vision projector: the engine command carries --mmproj, and llama-server with
the tiny model and tinygguf's tiny projector answers a chat completion that holds an image."""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

import gguf
import pytest
import requests

from llmgw import engine
from llmgw.tinygguf import (
    EMBEDDING_LENGTH,
    MMPROJ_IMAGE_SIZE,
    MMPROJ_PATCH_SIZE,
    write_tiny_mmproj,
    write_tiny_model,
)
from tests.support.engine import running_engine


def _settings(**changes: object) -> engine.EngineSettings:
    values: dict[str, object] = {
        "model_path": "/cache/m.gguf",
        "model_alias": "vision",
        "host": "127.0.0.1",
        "port": 9000,
        "context_length": 512,
    }
    values.update(changes)
    return engine.EngineSettings(**values)  # type: ignore[arg-type]


def test_it_passes_the_projector_with_mmproj() -> None:
    command = engine.engine_command(_settings(mmproj_path="/cache/mmproj.gguf"), "llama-server")
    at = command.index("--mmproj")
    assert command[at + 1] == "/cache/mmproj.gguf"


def test_it_passes_no_projector_for_a_text_model() -> None:
    assert "--mmproj" not in engine.engine_command(_settings(), "llama-server")


def tiny_png(width: int = 8, height: int = 8) -> bytes:
    """A small RGB PNG, written with the standard library."""
    rows = b"".join(
        b"\x00" + b"".join(bytes([(x * 31) % 256, (y * 29) % 256, 90]) for x in range(width))
        for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def image_chat_body() -> dict[str, object]:
    """A chat completion asking about a small PNG, sent as a data URL."""
    url = "data:image/png;base64," + base64.b64encode(tiny_png()).decode()
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is in the picture"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        "max_tokens": 3,
        "temperature": 0,
    }


def _image_chat(base: str) -> requests.Response:
    return requests.post(f"{base}/v1/chat/completions", json=image_chat_body(), timeout=60)


def test_the_tiny_projector_fits_the_tiny_model(tmp_path: Path) -> None:
    path = tmp_path / "mmproj.gguf"
    write_tiny_mmproj(path)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["clip.projector_type"].contents() == "mlp"
    assert reader.fields["general.type"].contents() == "mmproj"
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    # ggml's order (innermost first): mm.2 maps the projection's hidden width to the text
    # model's embedding, which llama.cpp requires to match.
    assert shapes["mm.2.weight"][1] == EMBEDDING_LENGTH
    assert path.stat().st_size < 200_000


def test_two_seeds_give_two_projectors(tmp_path: Path) -> None:
    write_tiny_mmproj(tmp_path / "a.gguf", seed=1)
    write_tiny_mmproj(tmp_path / "b.gguf", seed=2)
    write_tiny_mmproj(tmp_path / "c.gguf", seed=1)
    assert (tmp_path / "a.gguf").read_bytes() != (tmp_path / "b.gguf").read_bytes()
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "c.gguf").read_bytes()


@pytest.mark.engine
def test_the_engine_answers_an_image_with_the_tiny_projector(tmp_path: Path) -> None:
    model, mmproj = tmp_path / "tiny.gguf", tmp_path / "mmproj.gguf"
    write_tiny_model(model)
    write_tiny_mmproj(mmproj)
    with running_engine(model, mmproj=mmproj, log=tmp_path / "engine.log") as base:
        answer = _image_chat(base)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        # The image became one prompt token per patch, on top of the text's.
        patches = (MMPROJ_IMAGE_SIZE // MMPROJ_PATCH_SIZE) ** 2
        assert usage["prompt_tokens"] > patches
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.engine
def test_without_a_projector_the_engine_refuses_an_image(tmp_path: Path) -> None:
    """What the projector is for: the same request to the model alone is refused."""
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model)
    with running_engine(model, log=tmp_path / "engine.log") as base:
        answer = _image_chat(base)
        assert answer.status_code >= 400
