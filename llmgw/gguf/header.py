"""Read GGUF headers without reading (or downloading) the whole file.

A GGUF file starts with its header: magic, version, tensor count, metadata count, the typed
metadata key/value pairs, then one info record per tensor; the tensor data follows. Headers
are dominated by tokenizer arrays (0.7 MB to 16 MB), and the weights can be tens of gigabytes,
so this parser works on a prefix of the file, skips the bodies of long arrays, and tells the
caller how many bytes it needs when the prefix is too short (``NeedMoreData``).
``parse_growing`` grows that prefix from any source: a local file here, growing HTTP ``Range``
prefixes in llmgw.gguf.remote.

``gguf.GGUFReader`` is not used on purpose: it memory-maps a complete file, fails on a truncated
one and takes tens of seconds on real vocabularies.
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Arrays up to this length keep their values; longer ones keep only their length (tokenizer
# vocabularies have 32k-256k entries that nobody here needs).
SHORT_ARRAY_LIMIT = 16

# No real header comes near this; a length that would reach past it means a corrupt file, and
# refusing it early keeps a bogus 2**60 from turning into a request for 2**60 bytes.
MAX_HEADER_BYTES = 1 << 30
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8


class GGUFError(Exception):
    """A file is not a readable GGUF file, or its header could not be fetched."""


class NotGGUFError(GGUFError):
    """The data does not start with the GGUF magic."""


class TruncatedGGUFError(GGUFError):
    """The file ends before its header does."""


class HeaderTooLargeError(GGUFError):
    """The header is larger than the caller allows reading."""


class NeedMoreData(Exception):
    """The data ends before the header does; at least ``needed`` bytes (in total) are required.

    Not a GGUFError: nothing is wrong with the file, the prefix is just too short. ``needed`` is
    exact when the parser knows how long the missing part is (a string, a numeric array) and a
    lower bound otherwise (inside an array of strings), so readers should also grow
    geometrically.
    """

    def __init__(self, needed: int, have: int) -> None:
        super().__init__(
            f"The GGUF header needs at least {needed} bytes; only {have} are available."
        )
        self.needed = needed
        self.have = have


class ValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format and size of each fixed-size scalar type.
_SCALAR_FORMATS: dict[ValueType, str] = {
    ValueType.UINT8: "B",
    ValueType.INT8: "b",
    ValueType.UINT16: "H",
    ValueType.INT16: "h",
    ValueType.UINT32: "I",
    ValueType.INT32: "i",
    ValueType.FLOAT32: "f",
    ValueType.BOOL: "?",
    ValueType.UINT64: "Q",
    ValueType.INT64: "q",
    ValueType.FLOAT64: "d",
}
_SCALAR_SIZES = {vtype: struct.calcsize(fmt) for vtype, fmt in _SCALAR_FORMATS.items()}


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array: its item type and length, plus its values when it is short."""

    item_type: ValueType
    length: int
    values: list[Any] | None  # None when the body was skipped (longer than SHORT_ARRAY_LIMIT)

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the innermost (numpy's last axis)
    ggml_type: int
    offset: int  # relative to the start of the tensor data section


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo] | None  # None when the data ended before the tensor infos did
    header_bytes: int  # bytes parsed: through the tensor infos if parsed, else through metadata
    tensor_count: int = 0
    big_endian: bool = False
    file_size: int | None = None  # set by the readers when they learn it
    value_types: dict[str, ValueType] = field(default_factory=dict)

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    @property
    def file_type(self) -> str:
        """general.type; most model files do not set it, so missing means "model"."""
        value = self.metadata.get("general.type")
        return value if isinstance(value, str) else "model"

    @property
    def adapter_type(self) -> str | None:
        value = self.metadata.get("adapter.type")
        return value if isinstance(value, str) else None

    @property
    def name(self) -> str | None:
        value = self.metadata.get("general.name")
        return value if isinstance(value, str) else None

    @property
    def context_length(self) -> int | None:
        return self._architecture_int("context_length")

    @property
    def block_count(self) -> int | None:
        return self._architecture_int("block_count")

    @property
    def embedding_length(self) -> int | None:
        return self._architecture_int("embedding_length")

    @property
    def head_count(self) -> int | None:
        return self._architecture_int("attention.head_count")

    @property
    def head_count_kv(self) -> int | None:
        """KV heads; llama.cpp falls back to head_count when the key is missing (no GQA)."""
        value = self._architecture_int("attention.head_count_kv")
        return value if value is not None else self.head_count

    @property
    def tensor_data_offset(self) -> int | None:
        """Where the tensor data starts in the file, once the tensor infos have been parsed."""
        if self.tensors is None:
            return None
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            alignment = DEFAULT_ALIGNMENT
        return -(-self.header_bytes // alignment) * alignment

    @property
    def key_length(self) -> int | None:
        """Per-head key size when the header states it (else embedding_length / head_count)."""
        return self._architecture_int("attention.key_length")

    @property
    def value_length(self) -> int | None:
        return self._architecture_int("attention.value_length")

    def _architecture_int(self, suffix: str) -> int | None:
        if self.architecture is None:
            return None
        return _as_int(self.metadata.get(f"{self.architecture}.{suffix}"))


def _as_int(value: Any) -> int | None:
    """An integer hyperparameter; some architectures store per-layer arrays (take the largest)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, GGUFArray) and value.values:
        numbers = [v for v in value.values if isinstance(v, int) and not isinstance(v, bool)]
        return max(numbers) if numbers else None
    return None


# --------------------------------------------------------------------------------------------
# Parsing


class _Cursor:
    """Reads little- or big-endian values from a prefix, raising NeedMoreData past its end."""

    def __init__(self, data: bytes | bytearray | memoryview, endian: str = "<") -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.endian = endian

    def take(self, size: int) -> memoryview:
        end = self.pos + size
        if end > MAX_HEADER_BYTES:
            raise GGUFError(
                f"The GGUF header is corrupt: at byte {self.pos} it claims {size} more bytes, "
                f"which would take it past {MAX_HEADER_BYTES} bytes."
            )
        if end > len(self.data):
            raise NeedMoreData(end, len(self.data))
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def skip(self, size: int) -> None:
        self.take(size)

    def scalar(self, vtype: ValueType) -> Any:
        fmt = self.endian + _SCALAR_FORMATS[vtype]
        return struct.unpack(fmt, self.take(_SCALAR_SIZES[vtype]))[0]

    def u32(self) -> int:
        return int(self.scalar(ValueType.UINT32))

    def u64(self) -> int:
        return int(self.scalar(ValueType.UINT64))

    def string_bytes(self) -> memoryview:
        return self.take(self.u64())

    def string(self) -> str:
        # Values may hold arbitrary bytes (some vocabularies do); do not fail on them.
        return bytes(self.string_bytes()).decode("utf-8", errors="replace")


def parse_header(
    data: bytes | bytearray | memoryview, *, require_tensors: bool = False
) -> GGUFHeader:
    """Parse a GGUF header from ``data``, a prefix of the file (or the whole file).

    The metadata must be complete, else NeedMoreData. Tensor infos are parsed when ``data``
    holds them all; if it ends inside them, ``tensors`` is None (or NeedMoreData is raised when
    ``require_tensors``). Raises GGUFError for anything that is not a well-formed GGUF header.
    """
    cursor = _Cursor(data)
    version = _read_preamble(cursor)
    tensor_count = cursor.u64()
    kv_count = cursor.u64()
    # Every tensor info and key/value pair takes at least 8 + 4 + 8 bytes; bigger counts are lies.
    _check_count(tensor_count, "tensors", 20, cursor.pos)
    _check_count(kv_count, "metadata entries", 13, cursor.pos)

    metadata: dict[str, Any] = {}
    value_types: dict[str, ValueType] = {}
    for index in range(kv_count):
        key, vtype, value = _read_key_value(cursor, index)
        metadata[key] = value
        value_types[key] = vtype
    header = GGUFHeader(
        version=version,
        metadata=metadata,
        tensors=None,
        header_bytes=cursor.pos,
        tensor_count=tensor_count,
        big_endian=cursor.endian == ">",
        value_types=value_types,
    )

    try:
        header.tensors = [_read_tensor_info(cursor, index) for index in range(tensor_count)]
    except NeedMoreData:
        if require_tensors:
            raise
        return header
    header.header_bytes = cursor.pos
    return header


def _read_preamble(cursor: _Cursor) -> int:
    """Check the magic and version; switch the cursor to big-endian for big-endian files."""
    have = len(cursor.data)
    if have < 4:
        # Refuse garbage as soon as its first bytes disagree with the magic.
        if bytes(cursor.data) != GGUF_MAGIC[:have]:
            raise NotGGUFError(_not_gguf_message(bytes(cursor.data)))
        raise NeedMoreData(4, have)
    if bytes(cursor.take(4)) != GGUF_MAGIC:
        # Show more than the magic: an HTML page or an LFS pointer is recognisable from it.
        raise NotGGUFError(_not_gguf_message(bytes(cursor.data[:32])))
    version = cursor.u32()
    if version not in SUPPORTED_VERSIONS:
        # A big-endian file has its version byte-swapped when read as little-endian.
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in SUPPORTED_VERSIONS:
            cursor.endian = ">"
            return swapped
        raise GGUFError(
            f"GGUF version {version} is not supported; only versions "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))} are."
        )
    return version


def _not_gguf_message(start: bytes) -> str:
    if start[:4] == b"GGML" or start[:4] in (b"lmgg", b"fmgg", b"tjgg"):
        return f"This is not a GGUF file: it starts with {start[:4]!r}, an older GGML format."
    if start.lstrip()[:1] in (b"<", b"{"):
        return (
            f"This is not a GGUF file: it starts with {start[:16]!r}, which looks like an "
            "HTML or JSON page (a wrong URL or an error page?)."
        )
    if start.startswith(b"version https://git-lfs"):
        return "This is not a GGUF file: it is a Git LFS pointer, not the file it points to."
    return f"This is not a GGUF file: it starts with {start[:16]!r} instead of b'GGUF'."


def _check_count(count: int, what: str, min_size: int, pos: int) -> None:
    if pos + count * min_size > MAX_HEADER_BYTES:
        raise GGUFError(f"The GGUF header is corrupt: it claims {count} {what}.")


def _read_key_value(cursor: _Cursor, index: int) -> tuple[str, ValueType, Any]:
    raw_key = bytes(cursor.string_bytes())
    try:
        key = raw_key.decode("utf-8")
    except UnicodeDecodeError:
        raise GGUFError(
            f"The GGUF header is corrupt: metadata key #{index} is not UTF-8 ({raw_key[:32]!r})."
        ) from None
    vtype = _value_type(cursor.u32(), f"metadata key {key!r}")
    return key, vtype, _read_value(cursor, vtype, key)


def _value_type(raw: int, where: str) -> ValueType:
    try:
        return ValueType(raw)
    except ValueError:
        raise GGUFError(
            f"The GGUF header is corrupt: {where} has unknown value type {raw}."
        ) from None


def _read_value(cursor: _Cursor, vtype: ValueType, key: str, depth: int = 0) -> Any:
    if vtype is ValueType.STRING:
        return cursor.string()
    if vtype is ValueType.ARRAY:
        return _read_array(cursor, key, depth + 1)
    return cursor.scalar(vtype)


def _read_array(cursor: _Cursor, key: str, depth: int = 1) -> GGUFArray:
    # Real files nest arrays at most once or twice; deep nesting is garbage and would otherwise
    # end in a RecursionError instead of a GGUFError.
    if depth > MAX_ARRAY_DEPTH:
        raise GGUFError(
            f"The GGUF header is corrupt: the array {key!r} nests more than "
            f"{MAX_ARRAY_DEPTH} levels deep."
        )
    item_type = _value_type(cursor.u32(), f"the array {key!r}")
    length = cursor.u64()
    _check_count(length, f"items in the array {key!r}", _min_item_size(item_type), cursor.pos)
    if length <= SHORT_ARRAY_LIMIT:
        values = [_read_value(cursor, item_type, key, depth) for _ in range(length)]
        return GGUFArray(item_type=item_type, length=length, values=values)
    _skip_items(cursor, item_type, length, key, depth)
    return GGUFArray(item_type=item_type, length=length, values=None)


def _min_item_size(vtype: ValueType) -> int:
    if vtype is ValueType.STRING:
        return 8  # the length alone
    if vtype is ValueType.ARRAY:
        return 12  # item type and length
    return _SCALAR_SIZES[vtype]


def _skip_items(cursor: _Cursor, vtype: ValueType, count: int, key: str, depth: int) -> None:
    if vtype in _SCALAR_SIZES:
        cursor.skip(_SCALAR_SIZES[vtype] * count)  # one jump: NeedMoreData knows the exact end
    elif vtype is ValueType.STRING:
        for _ in range(count):
            cursor.skip(cursor.u64())
    else:
        for _ in range(count):
            _read_array(cursor, key, depth + 1)


def _read_tensor_info(cursor: _Cursor, index: int) -> TensorInfo:
    name = cursor.string()
    n_dims = cursor.u32()
    if n_dims > MAX_TENSOR_DIMS:
        raise GGUFError(
            f"The GGUF header is corrupt: tensor #{index} ({name!r}) claims {n_dims} dimensions; "
            f"at most {MAX_TENSOR_DIMS} are possible."
        )
    dims = tuple(cursor.u64() for _ in range(n_dims))
    ggml_type = cursor.u32()
    offset = cursor.u64()
    return TensorInfo(name=name, dims=dims, ggml_type=ggml_type, offset=offset)


# --------------------------------------------------------------------------------------------
# Reading from a file (a URL: llmgw.gguf.remote)


def read_header_from_file(
    path: str | os.PathLike[str], *, require_tensors: bool = True, first_bytes: int = 256 * 1024
) -> GGUFHeader:
    """Read the header of a local file, reading only as much of the file as the header needs."""
    try:
        with open(path, "rb") as file:
            file_size = os.fstat(file.fileno()).st_size

            def read_more(buffer: bytearray, target: int) -> bool:
                chunk = file.read(target - len(buffer))
                buffer += chunk
                return len(chunk) > 0

            # The end of the file, not a size limit, stops a local read.
            header = parse_growing(
                read_more,
                first_bytes,
                MAX_HEADER_BYTES,
                require_tensors,
                source=f"The file {path}",
            )
    except OSError as exc:
        raise GGUFError(f"Could not read {path}: {exc.strerror or exc}.") from exc
    header.file_size = file_size
    return header


def parse_growing(
    read_more: Callable[[bytearray, int], bool],
    first_bytes: int,
    max_bytes: int,
    require_tensors: bool,
    *,
    source: str,
) -> GGUFHeader:
    """Parse a prefix that ``read_more(buffer, target)`` grows towards ``target`` bytes.

    ``read_more`` returns False when the source has nothing more to give.
    """
    buffer = bytearray()
    target = max(1, min(first_bytes, max_bytes))
    while True:
        more = read_more(buffer, target)
        try:
            return parse_header(buffer, require_tensors=require_tensors)
        except NeedMoreData as need:
            if not more or len(buffer) < target:
                raise TruncatedGGUFError(
                    f"{source} ends after {len(buffer)} bytes, inside its GGUF header "
                    f"(which needs at least {need.needed}); the file is truncated."
                ) from None
            if need.needed > max_bytes:
                raise HeaderTooLargeError(
                    f"{source} has a GGUF header larger than the {max_bytes} bytes allowed "
                    f"(it needs at least {need.needed}); refusing to read more."
                ) from None
            # Doubling bounds the number of requests when `needed` is only a lower bound.
            target = min(max(need.needed, 2 * len(buffer)), max_bytes)
