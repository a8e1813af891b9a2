"""The mirror's files over HTTP, with Range support, for nodes and for header checks.

Files live at <mirror root>/<org>/<repo>/<commit>/<path>; the URL is /mirror/ + that path.
Only GET and HEAD; a path outside the root is refused.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.views.decorators.http import require_safe

from .config import current_config

CHUNK = 1024 * 1024
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def mirror_root() -> Path:
    return Path(current_config().mirror_root).resolve()


def _file_for(path: str) -> Path:
    root = mirror_root()
    candidate = (root / path).resolve()
    if root not in candidate.parents or not candidate.is_file():
        raise Http404(f"The mirror has no file {path}.")
    return candidate


def _read(path: Path, start: int, length: int) -> Iterator[bytes]:
    with path.open("rb") as handle:
        handle.seek(start)
        remaining = length
        while remaining > 0:
            chunk = handle.read(min(CHUNK, remaining))
            if not chunk:
                return
            remaining -= len(chunk)
            yield chunk


@require_safe
def serve(request: HttpRequest, path: str) -> HttpResponse | StreamingHttpResponse:
    file = _file_for(path)
    size = file.stat().st_size
    start, end, status = 0, size - 1, 200
    header = request.headers.get("Range", "")
    match = _RANGE.match(header.strip()) if header else None
    if match and (match.group(1) or match.group(2)):
        first, last = match.group(1), match.group(2)
        if first:
            start = int(first)
            end = min(int(last), size - 1) if last else size - 1
        else:  # the last N bytes
            start = max(size - int(last), 0)
        if start >= size or start > end:
            refusal = HttpResponse(status=416)
            refusal["Content-Range"] = f"bytes */{size}"
            return refusal
        status = 206
    length = end - start + 1 if size else 0
    if request.method == "HEAD":
        response: HttpResponse | StreamingHttpResponse = HttpResponse(status=status)
    else:
        response = StreamingHttpResponse(_read(file, start, length), status=status)
    response["Content-Length"] = str(length)
    response["Content-Type"] = "application/octet-stream"
    response["Accept-Ranges"] = "bytes"
    response["Last-Modified"] = _http_date(file.stat().st_mtime)
    if status == 206:
        response["Content-Range"] = f"bytes {start}-{end}/{size}"
    return response


def _http_date(timestamp: float) -> str:
    from django.utils.http import http_date

    return http_date(timestamp)


def mirror_url(relative: str) -> str:
    from django.conf import settings

    return f"{settings.LLMGW_PUBLIC_URL}/mirror/{relative.lstrip(os.sep)}"
