"""llmgw.gguf: reading GGUF headers from prefixes, files and URLs, and checking adapters.

Files are generated with llmgw.tinygguf and gguf.GGUFWriter; gguf.GGUFReader (which needs the
whole file) is the reference the parser is compared with.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.gguf import (
    SHORT_ARRAY_LIMIT,
    FetchError,
    GGUFArray,
    GGUFError,
    GGUFHeader,
    HeaderTooLargeError,
    NeedMoreData,
    NotGGUFError,
    TruncatedGGUFError,
    ValueType,
    adapter_problems,
    estimate_memory_bytes,
    kv_bytes_per_token,
    parse_header,
    read_header_from_file,
    read_header_from_url,
    serving_memory,
)
from llmgw.tinygguf import write_lora_adapter, write_tiny_model
from tests.support.http_files import serve_directory

MiB = 1024 * 1024


# --------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny model, adapters, and an ~8 MB model with a big tensor."""
    directory = tmp_path_factory.mktemp("gguf")
    write_tiny_model(directory / "tiny.gguf", seed=1)
    write_lora_adapter(directory / "lora.gguf")
    write_lora_adapter(directory / "lora-qwen2.gguf", architecture="qwen2")
    write_tiny_model(directory / "qwen2.gguf", architecture="qwen2")
    _write_big_model(directory / "big.gguf")
    _write_long_header_model(directory / "long-header.gguf")
    return directory


def _write_big_model(path: Path) -> None:
    """A model-like file whose weights (8 MB) dwarf its header, to count downloaded bytes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_llama_hyperparameters(writer)
    writer.add_tensor("token_embd.weight", np.zeros((4096, 512), dtype=np.float32))
    _write(writer)


def _write_long_header_model(path: Path) -> None:
    """A header of about 1 MB of tokenizer strings before the tensor infos, like real models."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_llama_hyperparameters(writer)
    writer.add_token_list([f"token-{i:06d}-" + "x" * 20 for i in range(30_000)])
    writer.add_token_scores([0.0] * 30_000)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    _write(writer)


def _add_llama_hyperparameters(writer: gguf.GGUFWriter) -> None:
    writer.add_context_length(4096)
    writer.add_embedding_length(512)
    writer.add_block_count(4)
    writer.add_head_count(8)
    writer.add_head_count_kv(8)


def _write(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reader_fields(path: Path) -> dict[str, Any]:
    """Metadata keys and scalar/string values as gguf.GGUFReader sees them."""
    reader = gguf.GGUFReader(str(path))
    fields = {}
    for name, reader_field in reader.fields.items():
        if name.startswith("GGUF."):  # the reader's pseudo-fields for the preamble
            continue
        if reader_field.types and reader_field.types[0] is gguf.GGUFValueType.ARRAY:
            fields[name] = ("array", len(reader_field.data))
        else:
            fields[name] = reader_field.contents()
    return fields


def _as_comparable(value: Any) -> Any:
    if isinstance(value, GGUFArray):
        return ("array", value.length)
    return value


# --------------------------------------------------------------------------------------------
# Parsing complete files, compared with gguf.GGUFReader


@pytest.mark.parametrize("name", ["tiny.gguf", "lora.gguf", "big.gguf", "long-header.gguf"])
def test_header_matches_gguf_reader(files: Path, name: str) -> None:
    path = files / name
    header = read_header_from_file(path)
    reader = gguf.GGUFReader(str(path))

    assert header.version == 3
    reader_fields = _reader_fields(path)
    assert list(header.metadata) == list(reader_fields)
    for key, expected in reader_fields.items():
        actual = _as_comparable(header.metadata[key])
        if isinstance(expected, float):
            assert actual == pytest.approx(expected), key
        else:
            assert actual == expected, key

    assert header.tensors is not None
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert mine.dims == tuple(int(d) for d in theirs.shape)
        assert mine.ggml_type == int(theirs.tensor_type)
        assert header.tensor_data_offset is not None
        assert header.tensor_data_offset + mine.offset == theirs.data_offset
    assert header.file_size == path.stat().st_size


def test_tiny_model_properties(files: Path) -> None:
    header = read_header_from_file(files / "tiny.gguf")
    assert header.architecture == "llama"
    assert header.file_type == "model"  # general.type is missing, as in most model files
    assert header.adapter_type is None
    assert header.name == "tiny-llama-seed1"
    assert (header.context_length, header.block_count, header.embedding_length) == (2048, 2, 64)
    assert (header.head_count, header.head_count_kv) == (4, 2)
    assert header.value_types["llama.block_count"] is ValueType.UINT32
    tokens = header.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, GGUFArray)
    assert tokens.item_type is ValueType.STRING
    assert tokens.values is None  # long arrays keep only their length
    reader = gguf.GGUFReader(str(files / "tiny.gguf"))
    assert len(tokens) == len(reader.fields["tokenizer.ggml.tokens"].data)


def test_adapter_properties(files: Path) -> None:
    header = read_header_from_file(files / "lora.gguf")
    assert header.file_type == "adapter"
    assert header.adapter_type == "lora"
    assert header.architecture == "llama"
    assert header.value_types["adapter.lora.alpha"] is ValueType.FLOAT32
    assert header.metadata["adapter.lora.alpha"] == 8.0


def test_every_value_type_and_nested_arrays(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1.5)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁wörld")
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 3.141592653589793)
    writer.add_array("t.short", [1, 2, 3])
    writer.add_array("t.strings", ["a", "bc"])
    writer.add_array("t.nested", [[1, 2], [3, 4, 5]])
    writer.add_array("t.long_nested", [[i, i] for i in range(SHORT_ARRAY_LIMIT + 4)])
    writer.add_array("t.long", list(range(SHORT_ARRAY_LIMIT + 1)))
    writer.add_key_value(
        "t.long_u8", list(range(40)), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8
    )
    _write(writer)

    meta = read_header_from_file(path).metadata
    assert meta["t.u8"] == 250 and meta["t.i8"] == -5
    assert meta["t.u16"] == 65000 and meta["t.i16"] == -30000
    assert meta["t.u32"] == 4_000_000_000 and meta["t.i32"] == -2_000_000_000
    assert meta["t.f32"] == 1.5 and meta["t.bool"] is True
    assert meta["t.str"] == "héllo ▁wörld"
    assert meta["t.u64"] == 2**63 + 5 and meta["t.i64"] == -(2**62)
    assert meta["t.f64"] == 3.141592653589793
    assert meta["t.short"] == GGUFArray(ValueType.INT32, 3, [1, 2, 3])
    assert meta["t.strings"] == GGUFArray(ValueType.STRING, 2, ["a", "bc"])
    nested = meta["t.nested"]
    assert nested.item_type is ValueType.ARRAY and nested.length == 2
    assert nested.values == [
        GGUFArray(ValueType.INT32, 2, [1, 2]),
        GGUFArray(ValueType.INT32, 3, [3, 4, 5]),
    ]
    assert meta["t.long_nested"] == GGUFArray(ValueType.ARRAY, SHORT_ARRAY_LIMIT + 4, None)
    assert meta["t.long"] == GGUFArray(ValueType.INT32, SHORT_ARRAY_LIMIT + 1, None)
    assert meta["t.long_u8"] == GGUFArray(ValueType.UINT8, 40, None)
    # Skipping the long arrays must land exactly on the next key: the metadata is all there.
    assert meta["general.architecture"] == "llama"


def test_big_endian_file(tmp_path: Path) -> None:
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_block_count(7)
    writer.add_array("t.long", list(range(100)))
    writer.add_tensor("x.weight", np.ones((3, 5), dtype=np.float32))
    _write(writer)

    header = read_header_from_file(path)
    assert header.big_endian and header.version == 3
    assert header.block_count == 7
    assert header.metadata["t.long"].length == 100
    assert header.tensors is not None and header.tensors[0].dims == (5, 3)


def test_version_2_header() -> None:
    data = _preamble(version=2, tensors=0, kvs=1) + _kv_string("general.architecture", "llama")
    header = parse_header(data)
    assert header.version == 2 and header.architecture == "llama"
    assert header.tensors == [] and header.header_bytes == len(data)


# --------------------------------------------------------------------------------------------
# Prefixes: NeedMoreData


def test_every_prefix_of_an_adapter_header_needs_more_data(files: Path) -> None:
    data = (files / "lora.gguf").read_bytes()
    full = parse_header(data, require_tensors=True)
    for length in range(full.header_bytes):
        with pytest.raises(NeedMoreData) as caught:
            parse_header(data[:length], require_tensors=True)
        assert caught.value.needed > length
        assert caught.value.needed <= full.header_bytes  # never asks for more than it needs
    assert parse_header(data[: full.header_bytes], require_tensors=True).tensors == full.tensors


def test_following_needed_reaches_the_full_header(files: Path) -> None:
    data = (files / "long-header.gguf").read_bytes()
    length, rounds = 0, 0
    while True:
        try:
            header = parse_header(data[:length])
            break
        except NeedMoreData as need:
            length, rounds = max(need.needed, 2 * length), rounds + 1
    assert header.metadata["tokenizer.ggml.tokens"].length == 30_000
    assert rounds < 30


def test_prefix_without_tensor_infos(files: Path) -> None:
    data = (files / "tiny.gguf").read_bytes()
    full = parse_header(data, require_tensors=True)
    metadata_only = parse_header(data[: full.header_bytes - 10])
    assert metadata_only.tensors is None
    assert metadata_only.metadata.keys() == full.metadata.keys()
    assert metadata_only.header_bytes < full.header_bytes
    assert metadata_only.tensor_data_offset is None
    with pytest.raises(NeedMoreData):
        parse_header(data[: full.header_bytes - 10], require_tensors=True)


def test_truncated_file_is_an_error(files: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes((files / "tiny.gguf").read_bytes()[:3000])
    with pytest.raises(TruncatedGGUFError, match="truncated"):
        read_header_from_file(truncated)


def test_missing_file_is_a_gguf_error(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="Could not read"):
        read_header_from_file(tmp_path / "nope.gguf")


# --------------------------------------------------------------------------------------------
# Garbage: GGUFError with a clear sentence


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"<!DOCTYPE html><html>Not found</html>", "not a GGUF file: it starts with"),
        (b'{"error": "Repository not found"}', "not a GGUF file: it starts with"),
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:", "Git LFS pointer"),
        (b"GGML" + bytes(100), "older GGML format"),
        (b"\x00\x01", "not a GGUF file: it starts with"),
    ],
    ids=["html", "json", "lfs-pointer", "ggml", "two-bytes"],
)
def test_not_gguf(data: bytes, message: str) -> None:
    with pytest.raises(NotGGUFError, match=message):
        parse_header(data)


def test_unsupported_version() -> None:
    with pytest.raises(GGUFError, match="version 1 is not supported"):
        parse_header(_preamble(version=1, tensors=0, kvs=0))


def test_absurd_string_length_is_refused_without_allocating() -> None:
    data = _preamble(version=3, tensors=0, kvs=1) + struct.pack("<Q", 2**60) + b"general"
    with pytest.raises(GGUFError, match="corrupt"):
        parse_header(data)


@pytest.mark.parametrize(
    "data",
    [
        struct.pack("<4sIQQ", b"GGUF", 3, 0, 2**62),
        struct.pack("<4sIQQ", b"GGUF", 3, 2**62, 0),
    ],
    ids=["metadata-count", "tensor-count"],
)
def test_absurd_counts_are_refused(data: bytes) -> None:
    with pytest.raises(GGUFError, match="corrupt"):
        parse_header(data)


def test_absurd_array_length_is_refused() -> None:
    body = _key("t.a") + struct.pack("<IIQ", ValueType.ARRAY, ValueType.UINT64, 2**58)
    with pytest.raises(GGUFError, match="corrupt"):
        parse_header(_preamble(version=3, tensors=0, kvs=1) + body)


def test_unknown_value_type() -> None:
    body = _key("t.x") + struct.pack("<I", 99)
    with pytest.raises(GGUFError, match="unknown value type 99"):
        parse_header(_preamble(version=3, tensors=0, kvs=1) + body)


def test_deeply_nested_arrays_are_refused() -> None:
    body = _key("t.deep") + struct.pack("<I", ValueType.ARRAY)
    body += struct.pack("<IQ", ValueType.ARRAY, 1) * 5000
    with pytest.raises(GGUFError, match="nests more than"):
        parse_header(_preamble(version=3, tensors=0, kvs=1) + body)


def test_too_many_tensor_dimensions() -> None:
    tensor = struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9)
    with pytest.raises(GGUFError, match="9 dimensions"):
        parse_header(_preamble(version=3, tensors=1, kvs=0) + tensor + bytes(100))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_random_bytes_after_a_valid_preamble_never_crash_the_parser(tail: bytes) -> None:
    data = _preamble(version=3, tensors=2, kvs=3) + tail
    with contextlib.suppress(GGUFError, NeedMoreData):
        parse_header(data)


_ADAPTER_BYTES: bytes | None = None


def _adapter_bytes() -> bytes:
    global _ADAPTER_BYTES
    if _ADAPTER_BYTES is None:
        import tempfile

        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "a.gguf"
            write_lora_adapter(path)
            _ADAPTER_BYTES = path.read_bytes()
    return _ADAPTER_BYTES


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_real_headers_fail_cleanly(data: st.DataObject) -> None:
    original = bytearray(_adapter_bytes()[:900])
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(original) - 1))
        original[position] = data.draw(st.integers(0, 255))
    with contextlib.suppress(GGUFError, NeedMoreData):
        parse_header(bytes(original))


def _preamble(*, version: int, tensors: int, kvs: int) -> bytes:
    return struct.pack("<4sIQQ", b"GGUF", version, tensors, kvs)


def _key(key: str) -> bytes:
    raw = key.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv_string(key: str, value: str) -> bytes:
    raw = value.encode()
    return _key(key) + struct.pack("<IQ", ValueType.STRING, len(raw)) + raw


# --------------------------------------------------------------------------------------------
# Over HTTP


@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "no-range"])
def test_read_over_http(files: Path, honour_range: bool) -> None:
    expected = read_header_from_file(files / "tiny.gguf")
    with serve_directory(files, honour_range=honour_range) as (base_url, stats):
        header = read_header_from_url(f"{base_url}/tiny.gguf", first_bytes=4096)
    assert header.metadata == expected.metadata
    assert header.file_size == expected.file_size
    statuses = {record.status for record in stats.requests}
    assert statuses == ({206} if honour_range else {200})
    if not honour_range:
        assert stats.request_count == 1  # the single 200 body is streamed, not re-requested


@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "no-range"])
def test_does_not_download_the_weights(files: Path, honour_range: bool) -> None:
    path = files / "big.gguf"
    size = path.stat().st_size
    assert size > 8 * MiB
    with serve_directory(files, honour_range=honour_range) as (base_url, stats):
        header = read_header_from_url(f"{base_url}/big.gguf")
    assert header.tensors is not None
    assert [t.name for t in header.tensors] == ["token_embd.weight"]
    assert header.file_size == size
    if honour_range:
        assert stats.requests[0].range == "bytes=0-262143"
        assert stats.bytes_sent == 256 * 1024
    else:
        # The server tried to send all 8 MB; the reader hung up after the header.
        assert stats.bytes_sent < 2 * MiB, stats.bytes_sent


@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "no-range"])
def test_long_header_grows_the_prefix(files: Path, honour_range: bool) -> None:
    path = files / "long-header.gguf"
    expected = read_header_from_file(path)
    with serve_directory(files, honour_range=honour_range) as (base_url, stats):
        header = read_header_from_url(f"{base_url}/long-header.gguf", first_bytes=16 * 1024)
    assert header.metadata == expected.metadata
    assert header.tensors == expected.tensors
    if honour_range:
        ranges = [record.range for record in stats.requests]
        assert len(ranges) > 2
        assert ranges[0] == "bytes=0-16383"
        # Later requests ask only for the missing part, so nothing is fetched twice.
        assert stats.bytes_sent <= path.stat().st_size
        assert all(not r.startswith("bytes=0-") for r in ranges[1:] if r is not None)


def test_header_larger_than_allowed(files: Path) -> None:
    with serve_directory(files) as (base_url, _stats):
        url = f"{base_url}/long-header.gguf"
        with pytest.raises(
            HeaderTooLargeError, match="larger than the 65536 bytes allowed"
        ) as caught:
            read_header_from_url(url, first_bytes=4096, max_bytes=64 * 1024)
    assert url in str(caught.value)


def test_http_error_status(files: Path) -> None:
    with serve_directory(files) as (base_url, _stats):
        url = f"{base_url}/missing.gguf"
        with pytest.raises(FetchError, match="HTTP 404") as caught:
            read_header_from_url(url)
    assert caught.value.status == 404 and caught.value.url == url
    assert url in str(caught.value)


def test_connection_refused() -> None:
    with socket.socket() as probe:  # a port nobody listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x.gguf"
    with pytest.raises(FetchError, match="Could not fetch the GGUF header from") as caught:
        read_header_from_url(url, timeout=2)
    assert url in str(caught.value)


@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "no-range"])
def test_truncated_file_over_http(tmp_path: Path, files: Path, honour_range: bool) -> None:
    (tmp_path / "cut.gguf").write_bytes((files / "long-header.gguf").read_bytes()[:100_000])
    with (
        serve_directory(tmp_path, honour_range=honour_range) as (base_url, _stats),
        pytest.raises(TruncatedGGUFError, match="truncated"),
    ):
        read_header_from_url(f"{base_url}/cut.gguf", first_bytes=16 * 1024)


def test_html_page_over_http(tmp_path: Path) -> None:
    (tmp_path / "page.gguf").write_bytes(b"<html><body>Sign in</body></html>")
    with (
        serve_directory(tmp_path) as (base_url, _stats),
        pytest.raises(NotGGUFError, match="HTML or JSON page"),
    ):
        read_header_from_url(f"{base_url}/page.gguf")


def test_uses_the_given_session(files: Path) -> None:
    session = requests.Session()
    session.headers["X-Test"] = "yes"
    with serve_directory(files) as (base_url, stats):
        read_header_from_url(f"{base_url}/lora.gguf", session=session)
    session.close()
    assert stats.request_count == 1


def test_http_server_serves_exact_ranges(files: Path) -> None:
    data = (files / "tiny.gguf").read_bytes()
    with serve_directory(files) as (base_url, stats):
        url = f"{base_url}/tiny.gguf"
        assert requests.get(url, headers={"Range": "bytes=10-19"}, timeout=5).content == data[10:20]
        assert requests.get(url, headers={"Range": "bytes=-5"}, timeout=5).content == data[-5:]
        whole = requests.get(url, timeout=5)
        beyond = requests.get(url, headers={"Range": f"bytes={len(data)}-"}, timeout=5)
        escape = requests.get(f"{base_url}/../../etc/passwd", timeout=5)
    assert hashlib.sha256(whole.content).digest() == hashlib.sha256(data).digest()
    assert beyond.status_code == 416 and escape.status_code == 404
    assert stats.bytes_sent == 10 + 5 + len(data)


# --------------------------------------------------------------------------------------------
# Adapters


def test_adapter_problems_accepts_the_right_adapter(files: Path) -> None:
    adapter = read_header_from_file(files / "lora.gguf")
    model = read_header_from_file(files / "tiny.gguf")
    assert adapter_problems(adapter, "llama") == []
    assert adapter_problems(adapter, "llama", model=model) == []


def test_adapter_problems_model_file(files: Path) -> None:
    model = read_header_from_file(files / "tiny.gguf")
    assert adapter_problems(model, "llama") == [
        "it is a model, not an adapter (general.type is missing)"
    ]


def test_adapter_problems_wrong_architecture(files: Path) -> None:
    adapter = read_header_from_file(files / "lora-qwen2.gguf")
    assert adapter_problems(adapter, "llama") == ["it is a LoRA adapter for qwen2, not for llama"]


def test_adapter_problems_model_of_another_architecture(files: Path) -> None:
    model = read_header_from_file(files / "qwen2.gguf")
    assert adapter_problems(model, "llama") == [
        "it is a model, not an adapter (general.type is missing)",
        "it is built for qwen2, not for llama",
    ]


def _adapter_header(tmp_path: Path, tensors: dict[str, tuple[int, ...]], **meta: str) -> GGUFHeader:
    path = tmp_path / "custom-adapter.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"general.type": "adapter", "adapter.type": "lora", **meta}.items():
        writer.add_string(key, value)
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    _write(writer)
    return read_header_from_file(path)


def test_adapter_problems_not_lora(tmp_path: Path) -> None:
    header = _adapter_header(tmp_path, {"x": (1,)}, **{"adapter.type": "control_vector"})
    assert adapter_problems(header, "llama") == [
        "it is a control_vector adapter, not a LoRA adapter"
    ]


def test_adapter_problems_missing_half_and_wrong_shape(files: Path, tmp_path: Path) -> None:
    model = read_header_from_file(files / "tiny.gguf")
    header = _adapter_header(
        tmp_path,
        {
            "blk.0.attn_q.weight.lora_a": (4, 64),  # fine with its lora_b below
            "blk.0.attn_q.weight.lora_b": (64, 4),
            "blk.0.attn_k.weight.lora_a": (4, 64),  # lora_b missing
            "blk.0.attn_v.weight.lora_a": (4, 48),  # attn_v takes 64 inputs, not 48
            "blk.0.attn_v.weight.lora_b": (32, 4),
            "blk.9.attn_q.weight.lora_a": (4, 64),  # the model has 2 blocks
            "blk.9.attn_q.weight.lora_b": (64, 4),
        },
    )
    problems = adapter_problems(header, "llama", model=model)
    assert problems == [
        "its tensor blk.0.attn_k.weight.lora_a has no matching blk.0.attn_k.weight.lora_b",
        "its tensors for blk.0.attn_v.weight have the wrong shape (a [48, 4], b [4, 32], "
        "model [64, 32])",
        "it changes the tensor blk.9.attn_q.weight, which the model does not have",
    ]


# --------------------------------------------------------------------------------------------
# Memory estimate


def test_estimate_memory_of_the_tiny_model(files: Path) -> None:
    path = files / "tiny.gguf"
    header = read_header_from_file(path)
    size = path.stat().st_size
    # 2 (K and V) x 2 blocks x 2048 positions x 2 KV heads x (64 / 4) dims x 2 bytes
    expected_kv = 2 * 2 * 2048 * 2 * 16 * 2
    estimate = estimate_memory_bytes(header, file_size=size)
    assert estimate.weights_bytes == size
    assert estimate.kv_cache_bytes == expected_kv == 524_288
    # The engine's prompt cache keeps one slot's worth of earlier prompts.
    assert estimate.prompt_cache_bytes == expected_kv
    assert estimate.total_bytes == size + 2 * expected_kv
    smaller = estimate_memory_bytes(header, file_size=size, context_length=256)
    assert smaller.kv_cache_bytes == expected_kv // 8


def test_estimate_memory_counts_the_kv_cache_of_every_slot(files: Path) -> None:
    header = read_header_from_file(files / "tiny.gguf")
    one = estimate_memory_bytes(header, file_size=1000, context_length=512)
    four = estimate_memory_bytes(header, file_size=1000, context_length=512, slots=4)
    assert four.kv_cache_bytes == 4 * one.kv_cache_bytes
    assert four.prompt_cache_bytes == one.prompt_cache_bytes
    assert four.total_bytes == 1000 + 5 * one.kv_cache_bytes


def test_estimate_memory_without_head_count_kv(files: Path) -> None:
    header = read_header_from_file(files / "big.gguf")
    # head_count_kv 8 == head_count: 2 x 4 blocks x 4096 x 8 heads x 64 dims x 2 bytes
    estimate = estimate_memory_bytes(header, file_size=1000)
    assert estimate.kv_cache_bytes == 2 * 4 * 4096 * 8 * 64 * 2
    del header.metadata["llama.attention.head_count_kv"]
    assert estimate_memory_bytes(header, file_size=1000) == estimate


def test_placement_and_the_node_estimate_memory_by_the_same_arithmetic(files: Path) -> None:
    # fleet.footprint keeps kv_bytes_per_token in the database and estimates with serving_memory;
    # the node estimates from the header on disk. The two must agree to the byte.
    header = read_header_from_file(files / "tiny.gguf")
    from_facts = serving_memory(
        weights_bytes=1000,
        kv_bytes_per_token=kv_bytes_per_token(header),
        context_length=512,
        slots=3,
    )
    assert from_facts == estimate_memory_bytes(header, file_size=1000, context_length=512, slots=3)


def test_estimate_memory_of_an_adapter_is_refused(files: Path) -> None:
    adapter = read_header_from_file(files / "lora.gguf")
    with pytest.raises(GGUFError, match=r"lacks llama\.block_count"):
        estimate_memory_bytes(adapter, file_size=100)
