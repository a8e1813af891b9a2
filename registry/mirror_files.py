"""The mirror's files over HTTP, with Range support, for nodes and for header checks.

Files live at <mirror root>/<org>/<repo>/<commit>/<path>; the URL is /mirror/ + that path.
Only GET and HEAD; a path outside the root is refused. Reading needs credentials
(llmgw_site.access); the control plane's own reads carry `catalog.mirror_credential`'s.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.utils.http import http_date
from django.views.decorators.http import require_safe

from catalog.config import current_config

CHUNK = 1024 * 1024
_RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$", re.ASCII)
# Positions past any file's size (a 2**63-byte file does not exist) are unsatisfiable; this
# also keeps int() away from numbers thousands of digits long.
_MAX_DIGITS = 19


# -- serving ----------------------------------------------------------------------------------


def mirror_root() -> Path:
    return Path(current_config().mirror_root).resolve()


def _file_for(path: str) -> Path:
    root = mirror_root()
    try:
        # A NUL byte or a name the file system cannot hold names no file (ValueError, OSError).
        candidate = (root / path).resolve()
        found = root in candidate.parents and candidate.is_file()
    except (ValueError, OSError):
        found = False
    if not found:
        raise Http404(f"The mirror has no file {path!r}.")
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
        if len(first) > _MAX_DIGITS or len(last) > _MAX_DIGITS:
            return _unsatisfiable(size)
        if first:
            start = int(first)
            end = min(int(last), size - 1) if last else size - 1
        else:  # the last N bytes
            start = max(size - int(last), 0)
        if start >= size or start > end:
            return _unsatisfiable(size)
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


def _unsatisfiable(size: int) -> HttpResponse:
    refusal = HttpResponse(
        f"The range asked for is not within the file, which is {size} bytes.\n",
        status=416,
        content_type="text/plain; charset=utf-8",
    )
    refusal["Content-Range"] = f"bytes */{size}"
    return refusal


def _http_date(timestamp: float) -> str:
    return http_date(timestamp)


def mirror_url(relative: str) -> str:
    return f"{settings.LLMGW_PUBLIC_URL}/mirror/{relative.lstrip(os.sep)}"
