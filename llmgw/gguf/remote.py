"""Read a remote GGUF file's header with growing HTTP Range requests, never its weights.

A server that ignores Range answers 200 with the whole file; the body is then read only as far
as the header needs and the connection dropped. The parsing is llmgw.gguf.header's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import requests

from .header import GGUFError, GGUFHeader, parse_growing


class FetchError(GGUFError):
    """An HTTP request for the header failed (connection error or an error status)."""

    def __init__(self, message: str, *, url: str, status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status


def read_header_from_url(
    url: str,
    *,
    session: requests.Session | None = None,
    timeout: float = 10,
    first_bytes: int = 256 * 1024,
    max_bytes: int = 64 * 1024 * 1024,
    require_tensors: bool = False,
) -> GGUFHeader:
    """Read the header of a remote GGUF file with growing HTTP Range requests.

    Starts with the first ``first_bytes`` and doubles (or jumps to what the parser says it
    needs) up to ``max_bytes``. Later requests ask only for the missing part. A server that
    ignores Range answers 200 with the whole file: then the body is read only as far as the
    header needs and the connection is closed, so the weights are never downloaded.
    """
    own_session = session is None
    http = session if session is not None else requests.Session()
    fetcher = _RangeFetcher(http, url, timeout)
    try:
        header = parse_growing(
            fetcher.read_more,
            first_bytes,
            max_bytes,
            require_tensors,
            source=f"The file at {url}",
        )
    finally:
        fetcher.close()
        if own_session:
            http.close()
    header.file_size = fetcher.file_size
    return header


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
_CHUNK = 64 * 1024


class _RangeFetcher:
    """Grows a buffer from a URL: Range requests, or one streamed 200 body if Range is ignored."""

    def __init__(self, session: requests.Session, url: str, timeout: float) -> None:
        self.session = session
        self.url = url
        self.timeout = timeout
        self.file_size: int | None = None
        self._stream: Iterator[bytes] | None = None  # the body of a 200 answer, read on demand
        self._response: requests.Response | None = None

    def read_more(self, buffer: bytearray, target: int) -> bool:
        if self._stream is None:
            response = self._request(len(buffer), target - 1)
            if response is None:  # 416: nothing at or past this offset
                return False
            if response.status_code == 200:
                # The server ignored Range and sends the file from byte 0: keep streaming it.
                buffer.clear()
                self._response = response
                self._stream = response.iter_content(chunk_size=_CHUNK)
                self.file_size = _int_header(response, "Content-Length")
            else:
                return self._read_partial(response, buffer, target)
        return self._read_stream(buffer, target)

    def _request(self, start: int, end: int) -> requests.Response | None:
        headers = {"Range": f"bytes={start}-{end}", "Accept-Encoding": "identity"}
        try:
            response = self.session.get(
                self.url, headers=headers, stream=True, timeout=self.timeout
            )
        except requests.RequestException as exc:
            raise FetchError(
                f"Could not fetch the GGUF header from {self.url}: {exc}.", url=self.url
            ) from exc
        if response.status_code == 416:
            response.close()
            return None
        if response.status_code not in (200, 206):
            response.close()
            raise FetchError(
                f"Could not fetch the GGUF header from {self.url}: the server answered "
                f"HTTP {response.status_code} {response.reason or ''}".rstrip()
                + ".",
                url=self.url,
                status=response.status_code,
            )
        return response

    def _read_partial(self, response: requests.Response, buffer: bytearray, target: int) -> bool:
        with response:
            start = len(buffer)
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
            if match is None or int(match.group(1)) != start:
                raise FetchError(
                    f"Could not fetch the GGUF header from {self.url}: asked for bytes from "
                    f"{start}, the server answered with Content-Range "
                    f"{response.headers.get('Content-Range')!r}.",
                    url=self.url,
                    status=response.status_code,
                )
            if match.group(3) != "*":
                self.file_size = int(match.group(3))
            self._fill(response.iter_content(chunk_size=_CHUNK), buffer, target)
            del buffer[target:]  # a server may send more than asked; keep the prefix exact
            return len(buffer) > start

    def _read_stream(self, buffer: bytearray, target: int) -> bool:
        assert self._stream is not None
        before = len(buffer)
        # Anything read past the target stays in the buffer: it is the next part of the prefix.
        self._fill(self._stream, buffer, target)
        return len(buffer) > before

    def _fill(self, chunks: Iterator[bytes], buffer: bytearray, target: int) -> None:
        """Append chunks until ``buffer`` reaches ``target`` or the body ends.

        Iterates with next() rather than a for loop over a wrapping generator: abandoning such
        a generator would close the body's iterator and lose the rest of a streamed 200 body.
        """
        while len(buffer) < target:
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            except requests.RequestException as exc:
                raise FetchError(
                    f"Could not fetch the GGUF header from {self.url}: the connection broke "
                    f"while reading ({exc}).",
                    url=self.url,
                ) from exc
            buffer += chunk

    def close(self) -> None:
        # Closing a streamed response drops the connection instead of downloading the rest.
        if self._response is not None:
            self._response.close()
            self._response = None
            self._stream = None


def _int_header(response: requests.Response, name: str) -> int | None:
    value = response.headers.get(name, "")
    return int(value) if value.isdigit() else None
