"""Sending a request on to a replica, and bringing its answer back without buffering a stream.

A request is sent once; it is sent again, once, to another ready replica only when
the first attempt failed before anything reached the client *and* either the
replica has been withdrawn since it was chosen (a rollout or an idle stop took it
away; it drains for fleet.services.DRAIN_SECONDS, but a request can still land on
it at the very end) or the connection was never made (nothing reached the engine).
A replica that took the request and then failed while still in routing is not
tried again elsewhere: the same request might well break the next one too.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import requests
import urllib3
from urllib3.exceptions import NewConnectionError, ReadTimeoutError

from . import conf
from .routing import Balancer, Candidate, Serve

CONNECT_TIMEOUT_SECONDS = 5

# Errors of the connection to a replica (refused, reset, cut mid-answer); urllib3's own
# come from reading a body that is not chunked.
CONNECTION_ERRORS = (
    requests.ConnectionError,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError,
)


class ReplicaGone(Exception):
    """No replica gave an answer: the chosen one failed, and a retry was not possible or failed."""

    def __init__(self, candidate: Candidate, cause: BaseException) -> None:
        super().__init__(f"replica {candidate.id} at {candidate.endpoint}: {cause}")
        self.candidate = candidate
        self.cause = cause


class ReplicaTimeout(Exception):
    def __init__(self, candidate: Candidate, seconds: float) -> None:
        super().__init__(f"replica {candidate.id} was silent for {seconds:.0f}s")
        self.candidate = candidate
        self.seconds = seconds


_local = threading.local()


def _session() -> requests.Session:
    """One session per thread (gunicorn's gthread workers keep their threads)."""
    session = getattr(_local, "session", None)
    if session is None:
        session = requests.Session()
        # Replicas are reached directly; a proxy from the environment must not get in the way.
        session.trust_env = False
        _local.session = session
    return session


@dataclass
class Answer:
    """A replica's answer: whole (`body`), or a stream that starts with `first`."""

    candidate: Candidate
    status: int
    content_type: str
    response: requests.Response
    body: bytes | None = None
    first: bytes = b""
    rest: Iterator[bytes] = field(default_factory=lambda: iter(()))
    retried: bool = False

    @property
    def streaming(self) -> bool:
        return self.body is None


def _in_chain(error: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    """Whether `error` is, or was caused by (requests and urllib3 wrap freely), one of `kinds`."""
    seen: set[int] = set()
    stack: list[object] = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kinds):
            return True
        if isinstance(current, BaseException):
            stack.extend([current.__cause__, current.__context__, *current.args])
            stack.append(getattr(current, "reason", None))
    return False


def never_connected(error: BaseException) -> bool:
    """Whether the engine cannot have seen the request: the connection was refused or timed out."""
    return _in_chain(error, (requests.ConnectTimeout, NewConnectionError, ConnectionRefusedError))


def should_retry(error: BaseException, *, still_routable: bool) -> bool:
    """Send the request to another replica? See the module's docstring for why these cases."""
    if not isinstance(error, CONNECTION_ERRORS):
        return False
    return not still_routable or never_connected(error)


def send(
    serve: Serve,
    path: str,
    payload: bytes,
    *,
    stream: bool,
    balancer: Balancer,
    refresh: Callable[[], tuple[Candidate, ...]],
) -> Answer:
    """Send to the least busy candidate; retry once (see should_retry). The caller must
    release the answer's candidate from `balancer` when the answer is done with."""
    candidates = serve.candidates
    for attempt in (1, 2):
        candidate = balancer.choose(candidates, serve.engine_name)
        try:
            answer = _attempt(candidate, path, payload, stream=stream)
        except (requests.ReadTimeout, *CONNECTION_ERRORS) as exc:
            balancer.release(candidate)
            # requests reports a read timeout inside a stream as a connection error.
            if _in_chain(exc, (requests.ReadTimeout, ReadTimeoutError)):
                raise ReplicaTimeout(candidate, conf.upstream_timeout()) from exc
            error: BaseException = exc
        else:
            answer.retried = attempt > 1
            return answer
        if attempt == 2:
            raise ReplicaGone(candidate, error)
        fresh = refresh()
        still_routable = any(c.id == candidate.id for c in fresh)
        others = tuple(c for c in fresh if c.id != candidate.id)
        if not others or not should_retry(error, still_routable=still_routable):
            raise ReplicaGone(candidate, error)
        candidates = others
    raise AssertionError("unreachable")


def _attempt(candidate: Candidate, path: str, payload: bytes, *, stream: bool) -> Answer:
    response = _session().post(
        f"{candidate.endpoint}{path}",
        data=payload,
        headers={
            "Content-Type": "application/json",
            # A kept-alive connection that the engine closes just as it is reused fails
            # in a way that cannot be told apart from an engine that died mid-request;
            # a connection per request (cheap next to any completion) has no such race.
            "Connection": "close",
        },
        stream=True,
        timeout=(CONNECT_TIMEOUT_SECONDS, conf.upstream_timeout()),
    )
    content_type = response.headers.get("Content-Type", "application/json")
    try:
        if stream and response.status_code == 200:
            chunks = _chunks(response)
            # The first chunk comes once the engine has started on this request: reading
            # it here means a replica that goes away while the request waits in its queue
            # can still be retried, before the client has been sent anything.
            first = next(chunks, b"")
            return Answer(candidate, 200, content_type, response, first=first, rest=chunks)
        body = response.content
    except BaseException:
        response.close()
        raise
    response.close()
    return Answer(candidate, response.status_code, content_type, response, body=body)


def _chunks(response: requests.Response) -> Generator[bytes, None, None]:
    """The body as it arrives: one HTTP chunk at a time (engines stream with chunked
    encoding), or whatever has arrived when the body is not chunked."""
    if response.raw.chunked:
        yield from response.iter_content(chunk_size=None)
        return
    while chunk := response.raw.read1(64 * 1024, decode_content=True):
        yield chunk


# -- tokens -----------------------------------------------------------------------------

_USAGE_NUMBER = re.compile(rb'"(prompt_tokens|completion_tokens)"\s*:\s*(\d+)')


def usage_of(body: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens from an answer's "usage", without parsing the whole body."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return 0, 0
    numbers = dict(_USAGE_NUMBER.findall(body[at : at + 400]))
    return int(numbers.get(b"prompt_tokens", 0)), int(numbers.get(b"completion_tokens", 0))


class StreamTally:
    """Tokens of a streamed answer, counted from the chunks as they pass.

    llama.cpp sends one event per generated token (its text may be empty while a
    multi-byte character is incomplete), plus a first chat event with the role and a
    last one with the finish reason; a "usage" event, when an engine sends one, wins.
    """

    def __init__(self) -> None:
        self.prompt = 0
        self.completion = 0
        self._usage: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> None:
        self.completion += (
            chunk.count(b'"finish_reason": null')
            + chunk.count(b'"finish_reason":null')
            - chunk.count(b'"role":')
        )
        if b'"usage"' in chunk:
            prompt, completion = usage_of(chunk)
            if prompt or completion:
                self._usage = (prompt, completion)

    def totals(self) -> tuple[int, int]:
        if self._usage is not None:
            return self._usage
        return self.prompt, max(self.completion, 0)
