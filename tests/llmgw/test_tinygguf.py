"""llmgw.tinygguf: the generated model and adapter are well-formed, and llama.cpp runs them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import pytest
import requests

from llmgw import engine, tinygguf
from llmgw.tinygguf import build_vocabulary, write_lora_adapter, write_tiny_model
from tests.support.engine import running_engine


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _field(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def _expected_model_tensors() -> dict[str, tuple[int, ...]]:
    """Tensor name -> ggml shape (innermost first, as GGUFReader reports it)."""
    n_vocab = len(build_vocabulary().tokens)
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (64, n_vocab)}
    for block in range(2):
        shapes |= {
            f"blk.{block}.attn_norm.weight": (64,),
            f"blk.{block}.attn_q.weight": (64, 64),
            f"blk.{block}.attn_k.weight": (64, 32),
            f"blk.{block}.attn_v.weight": (64, 32),
            f"blk.{block}.attn_output.weight": (64, 64),
            f"blk.{block}.ffn_norm.weight": (64,),
            f"blk.{block}.ffn_gate.weight": (64, 128),
            f"blk.{block}.ffn_up.weight": (64, 128),
            f"blk.{block}.ffn_down.weight": (128, 64),
        }
    shapes |= {"output_norm.weight": (64,), "output.weight": (64, n_vocab)}
    return shapes


def test_tiny_model_metadata_and_tensors(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, seed=3)
    assert 300_000 < path.stat().st_size < 1_000_000

    reader = gguf.GGUFReader(str(path))
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "general.name") == "tiny-llama-seed3"
    expected = {
        "llama.context_length": 2048,
        "llama.embedding_length": 64,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 16,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": tinygguf.CHAT_TEMPLATE,
    }
    for key, value in expected.items():
        assert _field(reader, key) == value, key
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert "general.type" not in reader.fields  # like most real model files

    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert shapes == _expected_model_tensors()
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}


def test_vocabulary_is_a_working_sentencepiece_vocabulary() -> None:
    vocab = build_vocabulary()
    assert vocab.tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert vocab.tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(vocab.token_types[3:259]) == {gguf.TokenType.BYTE}
    assert vocab.token_types[1:3] == [gguf.TokenType.CONTROL] * 2
    assert len(set(vocab.tokens)) == len(vocab.tokens)
    assert len(vocab.scores) == len(vocab.token_types) == len(vocab.tokens)
    pieces = set(vocab.tokens[259:])
    assert "\u2581hello" in pieces
    # SPM only merges into a piece whose prefixes are all pieces too.
    for piece in pieces:
        for end in range(2, len(piece)):
            assert piece[:end] in pieces, (piece, piece[:end])


def test_seeds_make_different_weights(tmp_path: Path) -> None:
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        write_tiny_model(tmp_path / f"{name}.gguf", seed=seed)
    assert _sha256(tmp_path / "a.gguf") == _sha256(tmp_path / "b.gguf")  # reproducible
    assert _sha256(tmp_path / "a.gguf") != _sha256(tmp_path / "c.gguf")
    # Same header apart from the name: a new revision of the same model.
    a = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    c = gguf.GGUFReader(str(tmp_path / "c.gguf"))
    assert [t.name for t in a.tensors] == [t.name for t in c.tensors]


def test_other_architecture_and_context_length(tmp_path: Path) -> None:
    path = tmp_path / "qwen2.gguf"
    write_tiny_model(path, architecture="qwen2", context_length=512)
    reader = gguf.GGUFReader(str(path))
    assert _field(reader, "general.architecture") == "qwen2"
    assert _field(reader, "qwen2.context_length") == 512
    assert "llama.context_length" not in reader.fields


def test_lora_adapter(tmp_path: Path) -> None:
    path = tmp_path / "lora.gguf"
    write_lora_adapter(path, rank=8, alpha=16.0)
    reader = gguf.GGUFReader(str(path))
    assert _field(reader, "general.type") == "adapter"
    assert _field(reader, "adapter.type") == "lora"
    assert _field(reader, "general.architecture") == "llama"
    assert reader.fields["adapter.lora.alpha"].types == [gguf.GGUFValueType.FLOAT32]
    assert _field(reader, "adapter.lora.alpha") == 16.0

    model_shapes = _expected_model_tensors()
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert len(shapes) == 8
    for name, (a_in, a_rank) in shapes.items():
        if not name.endswith(".lora_a"):
            continue
        base = name.removesuffix(".lora_a")
        b_rank, b_out = shapes[f"{base}.lora_b"]
        # ggml order: a is (in, r), b is (r, out); the base is (in, out).
        assert a_rank == b_rank == 8
        assert (a_in, b_out) == model_shapes[base]


def test_lora_adapter_seeds_and_architecture(tmp_path: Path) -> None:
    write_lora_adapter(tmp_path / "a.gguf", seed=0)
    write_lora_adapter(tmp_path / "b.gguf", seed=1)
    write_lora_adapter(tmp_path / "q.gguf", architecture="qwen2")
    assert _sha256(tmp_path / "a.gguf") != _sha256(tmp_path / "b.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "q.gguf"))
    assert _field(reader, "general.architecture") == "qwen2"


def test_lora_rank_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        write_lora_adapter(tmp_path / "bad.gguf", rank=0)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tinygguf.main(["model", str(tmp_path / "m.gguf"), "--seed", "2"]) == 0
    assert tinygguf.main(["adapter", str(tmp_path / "a.gguf"), "--rank", "2"]) == 0
    assert "wrote" in capsys.readouterr().out
    write_tiny_model(tmp_path / "same.gguf", seed=2)
    assert _sha256(tmp_path / "m.gguf") == _sha256(tmp_path / "same.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    assert int(reader.tensors[0].shape[1]) == 2


@pytest.mark.engine
@pytest.mark.skipif(engine.find_engine() is None, reason="llama-server is not built (make setup)")
def test_llama_cpp_runs_the_tiny_model_and_adapter(tmp_path: Path) -> None:
    model, adapter = tmp_path / "tiny.gguf", tmp_path / "lora.gguf"
    write_tiny_model(model)
    write_lora_adapter(adapter)
    adapters = (engine.AdapterEntry("tiny-lora", str(adapter), 1.0),)

    with running_engine(model, adapters=adapters, log=tmp_path / "engine.log") as url:
        tokens = requests.post(
            f"{url}/tokenize", json={"content": "hello world", "add_special": True}, timeout=30
        ).json()["tokens"]
        body = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "seed": 1}
        plain = requests.post(f"{url}/v1/completions", json=body, timeout=30).json()
        lora = engine.lora_request(adapters, "tiny-lora")
        adapted = requests.post(
            f"{url}/v1/completions", json={**body, "lora": lora}, timeout=30
        ).json()
        chat = requests.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6},
            timeout=30,
        ).json()

    vocab = build_vocabulary().tokens
    # BOS, then whole words: the prefixes in the vocabulary let SPM merge them.
    assert tokens == [1, vocab.index("\u2581hello"), vocab.index("\u2581world")]
    assert plain["usage"]["completion_tokens"] > 0 and plain["choices"][0]["text"]
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["prompt_tokens"] > 3  # the template was rendered around the message
    assert adapted["usage"]["completion_tokens"] > 0
    assert adapted["choices"][0]["text"] != plain["choices"][0]["text"]  # the adapter applied
