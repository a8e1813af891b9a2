"""Hashing beside a download instead of between its reads.

sha256 runs at about 1.7 GB/s here and a local download at about 400 MB/s: done
in line it costs a fifth of the throughput. hashlib releases the GIL on large
buffers, so a thread hashing the chunks already received overlaps with the
socket reads and the writes.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from typing import Any


class BackgroundHasher:
    def __init__(self, *algorithms: str, prefix: bytes = b"", backlog: int = 16) -> None:
        self._hashes: list[Any] = [hashlib.new(name) for name in algorithms]
        if prefix:
            for h in self._hashes:
                h.update(prefix)
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=backlog)
        self._thread = threading.Thread(target=self._run, name="hasher", daemon=True)
        self._thread.start()
        self._done = False

    def _run(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                return
            for h in self._hashes:
                h.update(chunk)

    def update(self, chunk: bytes) -> None:
        # The bounded queue keeps memory flat when the network outruns the hash.
        self._queue.put(chunk)

    def hexdigests(self) -> list[str]:
        if not self._done:
            self._queue.put(None)
            self._thread.join()
            self._done = True
        return [h.hexdigest() for h in self._hashes]

    def close(self) -> None:
        """Stop the thread without waiting for a result (the download failed)."""
        if not self._done:
            self._queue.put(None)
            self._done = True
