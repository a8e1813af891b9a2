"""Asking a source URL whether the weights are there, before the catalog refers to it.

A source that does not resolve is otherwise discovered minutes later by a
replica failing to start on some node, with an error naming the node rather
than the typo. Which hosts may be asked is a setting, so that the check cannot
be used to probe arbitrary internal addresses.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import requests
from django.conf import settings

from .config import current_config
from .errors import CatalogError
from .mirror_files import control_plane_session

ANYWAY = (
    "Pass --no-source-check (source_check=false in the API) to add it anyway, which is right "
    "when the mirror is not up yet or the nodes reach it by an address the control plane does not."
)
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class SourceInfo:
    url: str
    size: int | None


def _host_key(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url)
    return (parts.hostname or "").lower(), parts.port


def host_allowed(url: str, allowed: tuple[str, ...]) -> bool:
    host, port = _host_key(url)
    for entry in allowed:
        entry = entry.strip().lower()
        if ":" in entry and not entry.startswith("["):
            name, _, entry_port = entry.rpartition(":")
            if name == host and port is not None and str(port) == entry_port:
                return True
            if name == host and port is None and entry_port in {"80", "443"}:
                return True
        elif entry.strip("[]") == host:
            return True
    return False


def _refuse_host(url: str, allowed: tuple[str, ...]) -> CatalogError:
    host, port = _host_key(url)
    shown = f"{host}:{port}" if port else host
    return CatalogError(
        f"The control plane may not ask {shown} whether {url} exists: that host is not in "
        f"sources.allowed_hosts in server.yaml (nor LLMGW_SOURCE_ALLOWED_HOSTS), which now allows "
        f"{', '.join(allowed) or 'no host'}. Add the host there, or: {ANYWAY}",
        code="source_host_not_allowed",
    )


def check_source(url: str, *, what: str = "source") -> SourceInfo:
    """Where the weights at `url` are and how large they are; CatalogError when they are not there."""
    allowed = current_config().source_allowed_hosts()
    timeout = settings.LLMGW_SOURCE_CHECK_TIMEOUT
    session = control_plane_session()
    current = url
    try:
        for _ in range(MAX_REDIRECTS + 1):
            if not host_allowed(current, allowed):
                raise _refuse_host(current, allowed)
            response = session.head(current, allow_redirects=False, timeout=timeout)
            if response.status_code in (405, 501) or (
                response.ok and "content-length" not in response.headers
            ):
                # Some servers do not answer HEAD, or not with a size: one byte
                # of the file tells both whether it is there and how large it is.
                response = session.get(
                    current,
                    headers={"Range": "bytes=0-0"},
                    allow_redirects=False,
                    timeout=timeout,
                    stream=True,
                )
                response.close()
            if response.is_redirect:
                current = urljoin(current, response.headers["location"])
                continue
            if not response.ok:
                raise CatalogError(
                    f"The {what} {url} is not there: it answered {response.status_code} "
                    f"{response.reason}. Check the URL. {ANYWAY}",
                    code="source_missing",
                )
            return SourceInfo(url=current, size=_size_of(response))
    except requests.RequestException as exc:
        raise CatalogError(
            f"The {what} {url} could not be reached: {_reason(exc)}. {ANYWAY}",
            code="source_unreachable",
        ) from None
    raise CatalogError(
        f"The {what} {url} redirects more than {MAX_REDIRECTS} times. {ANYWAY}",
        code="source_unreachable",
    )


def _size_of(response: requests.Response) -> int | None:
    content_range = response.headers.get("content-range", "")
    if response.status_code == 206 and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        return int(total) if total.isdigit() else None
    length = response.headers.get("content-length")
    return int(length) if length and length.isdigit() else None


def _reason(exc: requests.RequestException) -> str:
    if isinstance(exc, requests.ConnectionError):
        return "nothing answered there (connection refused or the host is unknown)"
    if isinstance(exc, requests.Timeout):
        return f"no answer within {settings.LLMGW_SOURCE_CHECK_TIMEOUT}s"
    return str(exc)


def human_size(size: int | None) -> str:
    if size is None:
        return "size unknown"
    value = float(size)
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} bytes"


def check_adapter(adapter: dict[str, object], *, model_name: str, model_source: str) -> SourceInfo:
    """The adapter must be a GGUF LoRA adapter for the model's architecture.

    llama.cpp takes a wrong adapter without complaint at start and crashes on
    the first request, so it is refused here, from the two files' headers read
    over HTTP Range requests, before it is stored.
    """
    from llmgw import gguf

    source = str(adapter["source"])
    name = str(adapter["name"])
    info = check_source(source, what=f"adapter {name}")
    allowed = current_config().source_allowed_hosts()
    if not host_allowed(model_source, allowed):
        raise _refuse_host(model_source, allowed)
    try:
        timeout = settings.LLMGW_SOURCE_CHECK_TIMEOUT
        with control_plane_session() as session:
            model_header = gguf.read_header_from_url(
                model_source, session=session, timeout=timeout, require_tensors=True
            )
            adapter_header = gguf.read_header_from_url(
                info.url, session=session, timeout=timeout, require_tensors=True
            )
    except gguf.GGUFError as exc:
        raise CatalogError(
            f"Adapter {name} could not be checked against model {model_name}: {exc}",
            code="adapter_unreadable",
        ) from None
    architecture = model_header.architecture or "unknown"
    problems = gguf.adapter_problems(adapter_header, architecture, model=model_header)
    if problems:
        raise CatalogError(
            f"Adapter {name} ({source}) cannot be used with model {model_name}: "
            f"{'; '.join(problems)}. An adapter must be a GGUF LoRA adapter made for the "
            f"model's architecture ({architecture}).",
            code="adapter_mismatch",
        )
    return info
