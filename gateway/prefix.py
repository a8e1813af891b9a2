"""Prefix-cache-aware routing: send a request where its prompt's beginning was computed recently.

The default engine's server keeps each slot's prompt in its KV cache (and earlier prompts in its RAM
cache), so a request whose prompt starts like one the same replica served a moment ago skips
most of its prefill: a conversation's earlier turns, a long system prompt shared by many
requests. The gateway cannot see those caches, but it can remember where it sent what: a
prompt's chained block hashes (`block_hashes`) with the replica chosen, in a fixed-size table
every gateway process of the machine maps (`PrefixTable`). How a replica is then chosen, and
what it saves: docs/gateway.md.
"""

from __future__ import annotations

import hashlib
import struct
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .boards import map_shared

BLOCK_CHARS = 256
MAX_BLOCKS = 256  # 64k characters: beyond that a prompt's beginning decides alone
# A slot per hash, 16 bytes each: 1 MB however many prompts come. An old entry is simply
# overwritten, which only makes a later choice less informed, never wrong.
TABLE_ENTRIES = 1 << 16
# A remembered beginning older than this is not taken.
TTL_SECONDS = 600
# How many more requests in flight the replica with the prefix may have than the least loaded
# (Balancer.choose), so that a hot prefix cannot pull the whole load onto one replica.
SLACK = 2
_ENTRY = struct.Struct("<QII")  # prefix hash, replica id's crc32, unix time


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI's content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request's prompt starts with, as the engine will see it (roughly)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(
            f"{m.get('role', '')}\x00{_text_of(m.get('content'))}\x00"
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
    return prompt if isinstance(prompt, str) else ""


def responses_prompt_text(body: dict[str, Any]) -> str:
    """A Responses API request's prompt: its instructions, then its input's items."""
    head = body.get("instructions")
    text = f"system\x00{head}\x00" if isinstance(head, str) else ""
    value = body.get("input")
    if isinstance(value, str):
        return f"{text}user\x00{value}\x00"
    if not isinstance(value, list):
        return text
    return text + "".join(
        f"{item.get('role', item.get('type', ''))}\x00{_text_of(item.get('content'))}\x00"
        for item in value
        if isinstance(item, dict)
    )


def anthropic_prompt_text(body: dict[str, Any]) -> str:
    """A Messages API request's prompt: its system prompt, then its messages."""
    system = body.get("system")
    text = f"system\x00{_text_of(system)}\x00" if system is not None else ""
    return text + prompt_text(body)


def block_hashes(text: str, engine_name: str) -> list[int]:
    """Chained hashes of the text's whole blocks (a last partial block counts too): block i's
    covers blocks 0..i, so equal hashes mean equal beginnings."""
    hashes: list[int] = []
    running = hashlib.blake2b(engine_name.encode(), digest_size=8)
    for start in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS), BLOCK_CHARS):
        running.update(text[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        # 0 marks an empty table entry, so no real hash may be 0.
        hashes.append(int.from_bytes(running.copy().digest(), "little") or 1)
    return hashes


def replica_tag(replica_id: str) -> int:
    return zlib.crc32(replica_id.encode()) or 1


class PrefixTable:
    """Recent prefix → replica choices, in a file every gateway process maps (or in memory).

    Processes write entries without a lock (gateway.boards.map_shared): an entry torn by two
    writers at once has a hash that matches nothing, or sends one request to a replica that
    lacks its prefix (computed in full there): routing stays correct, only the cache is missed.
    """

    def __init__(self, folder: Path | None) -> None:
        size = TABLE_ENTRIES * _ENTRY.size
        self._map = map_shared(folder / "prefixes", size) if folder is not None else None
        self._buffer: Any = self._map if self._map is not None else bytearray(size)

    def remember(self, hashes: Sequence[int], replica_id: str, now: float | None = None) -> None:
        tag, stamp = replica_tag(replica_id), int(now if now is not None else time.time())
        for value in hashes:
            _ENTRY.pack_into(self._buffer, (value % TABLE_ENTRIES) * _ENTRY.size, value, tag, stamp)

    def longest(
        self, hashes: Sequence[int], replica_ids: Sequence[str], now: float | None = None
    ) -> tuple[str, int] | None:
        """The candidate that served the longest remembered beginning, and its length in blocks."""
        by_tag = {replica_tag(r): r for r in replica_ids}
        oldest = int(now if now is not None else time.time()) - TTL_SECONDS
        for depth in range(len(hashes), 0, -1):
            value = hashes[depth - 1]
            found, tag, stamp = _ENTRY.unpack_from(
                self._buffer, (value % TABLE_ENTRIES) * _ENTRY.size
            )
            if found == value and stamp >= oldest and tag in by_tag:
                return by_tag[tag], depth
        return None

    def size(self) -> int:
        """Entries in use (a prefix's hash written there), at most TABLE_ENTRIES. One pass over
        the table (a millisecond or two): for /metrics, not for a request's path."""
        with memoryview(self._buffer) as raw, raw.cast("Q") as words:
            hashes = words[::2]  # an entry is its hash (one word), then its tag and stamp
            try:
                return len(hashes) - hashes.tolist().count(0)
            finally:
                hashes.release()

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
