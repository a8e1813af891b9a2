"""Asking a source URL whether the weights are there, before the catalog refers to it.

A source that does not resolve is otherwise discovered minutes later by a
replica failing to start on some node, with an error naming the node rather
than the typo. Which hosts may be asked is a setting, so that the check cannot
be used to probe arbitrary internal addresses; `core.outbound` checks every
request and redirect hop against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urljoin

import requests
from django.conf import settings

from core.outbound import MAX_REDIRECTS, HostPolicy, URLRefused, guarded_session
from core.refusals import Refused
from llmgw.engines import get_engine
from llmgw.engines.base import WeightsUnreadable
from llmgw.units import format_bytes

from .config import current_config
from .mirror_credential import ControlPlaneAuth

ANYWAY = (
    "Pass --no-source-check (source_check=false in the API) to add it anyway, which is right "
    "when the mirror is not up yet or the nodes reach it by an address the control plane does not."
)


@dataclass(frozen=True)
class SourceInfo:
    url: str
    size: int | None


def source_policy() -> HostPolicy:
    """The hosts a source or adapter URL may be fetched from (core.outbound says how)."""
    return HostPolicy(current_config().source_allowed_hosts())


def source_session() -> requests.Session:
    """A session for fetching sources: every request and redirect hop checked against the
    policy, with the control plane's credential for its own mirror (and nowhere else)."""
    session = guarded_session(source_policy())
    session.auth = ControlPlaneAuth()
    return session


def _refusal(exc: URLRefused, url: str, current: str, what: str) -> Refused:
    hop = f"The {what} {url} redirects to {current}. " if current != url else ""
    return Refused(f"{hop}{exc.message} Or: {ANYWAY}", code=exc.code)


def check_source(url: str, *, what: str = "source") -> SourceInfo:
    """Where the weights at `url` are and how large they are; Refused when they are not there."""
    timeout = settings.LLMGW_SOURCE_CHECK_TIMEOUT
    current = url
    try:
        with source_session() as session:
            for _ in range(MAX_REDIRECTS + 1):
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
                    raise Refused(
                        f"The {what} {url} is not there: it answered {response.status_code} "
                        f"{response.reason}. Check the URL. {ANYWAY}",
                        code="source_missing",
                    )
                return SourceInfo(url=current, size=_size_of(response))
    except URLRefused as exc:
        raise _refusal(exc, url, current, what) from None
    except requests.RequestException as exc:
        raise Refused(
            f"The {what} {url} could not be reached: {_reason(exc)}. {ANYWAY}",
            code="source_unreachable",
        ) from None
    raise Refused(
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
    """A source's size in llmgw.units' words, so that `model add` and `model plan` print the
    same file as the same figure (this once printed decimal units beside plan's 1024s)."""
    return "size unknown" if size is None else format_bytes(size)


def check_adapter(adapter: dict[str, object], *, model_name: str, model_source: str) -> SourceInfo:
    """The adapter must be one the model's engine can load for the model: its engine reads both
    files' headers over HTTP Range requests before the adapter is stored, because an engine may
    take a wrong adapter without complaint at start and crash on the first request.
    """
    source = str(adapter["source"])
    name = str(adapter["name"])
    info = check_source(source, what=f"adapter {name}")
    engine = get_engine()
    try:
        with source_session() as session:
            architecture, problems = engine.adapter_problems(
                model_source,
                info.url,
                session=session,
                timeout=settings.LLMGW_SOURCE_CHECK_TIMEOUT,
            )
    except WeightsUnreadable as exc:
        if isinstance(exc.__cause__, URLRefused):
            refused = exc.__cause__
            raise Refused(f"{refused.message} Or: {ANYWAY}", code=refused.code) from None
        raise Refused(
            f"Adapter {name} could not be checked against model {model_name}: {exc}",
            code="adapter_unreadable",
        ) from None
    if problems:
        raise Refused(
            f"Adapter {name} ({source}) cannot be used with model {model_name}: "
            f"{'; '.join(problems)}. An adapter must be a {engine.weights_format.upper()} LoRA "
            f"adapter made for the model's architecture ({architecture}).",
            code="adapter_mismatch",
        )
    return info
