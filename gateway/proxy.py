"""Sending a request on to a replica, and bringing its answer back without buffering a stream.

A request is sent once. It is sent again, once, to another ready replica only when
the first attempt failed before anything reached the client, and either

- the connection was never made (refused, unreachable): the engine cannot have seen
  the request, so sending it elsewhere is always safe; or
- the replica was withdrawn since it was chosen: a rollout or an idle stop took it
  away. It drains for fleet.services.DRAIN_SECONDS before it stops, so this is rare,
  but a request queued behind others can still be cut off when it stops.

A replica that took the request and then failed while still in routing is not
tried again elsewhere: the same request might well break the next one too.

The gateway talks to engines with http.client, one connection per request. A
connection kept alive and reused can be closed by the engine just as it is reused,
which looks exactly like an engine that died with the request; a fresh connection
(cheap next to any completion) has no such race, and knowing whether the
connection was made at all is what the retry rule needs. requests would add about
a millisecond of CPU per request on top, for nothing used here.
"""

from __future__ import annotations

import http.client
import re
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

from . import conf
from .routing import Balancer, Candidate, Serve

CONNECT_TIMEOUT_SECONDS = 5
READ_BYTES = 64 * 1024


class UpstreamError(Exception):
    """An attempt to reach a replica failed."""


class NotConnected(UpstreamError):
    """The connection was never made: the engine did not see the request."""


class Broken(UpstreamError):
    """The connection failed after the request was sent, before an answer came."""


class Silent(UpstreamError):
    """The engine said nothing for the upstream timeout."""


# What reading a stream can raise once it has started.
STREAM_ERRORS = (OSError, http.client.HTTPException)


class ReplicaGone(Exception):
    """No replica gave an answer: the chosen one failed, and a retry was not possible or failed."""

    def __init__(self, candidate: Candidate, cause: BaseException) -> None:
        super().__init__(f"replica {candidate.id} at {candidate.endpoint}: {cause}")
        self.candidate = candidate
        self.cause = cause


class ReplicaTimeout(Exception):
    def __init__(self, candidate: Candidate, seconds: float) -> None:
        super().__init__(
            f"replica {candidate.id} at {candidate.endpoint} was silent for {seconds:.0f}s"
        )
        self.candidate = candidate
        self.seconds = seconds


@dataclass
class Answer:
    """A replica's answer: whole (`body`), or a stream that starts with `first`."""

    candidate: Candidate
    status: int
    content_type: str
    connection: http.client.HTTPConnection
    body: bytes | None = None
    first: bytes = b""
    rest: Iterator[bytes] = field(default_factory=lambda: iter(()))
    retried: bool = False

    @property
    def streaming(self) -> bool:
        return self.body is None

    def close(self) -> None:
        self.connection.close()


def should_retry(error: BaseException, *, still_routable: bool) -> bool:
    """Send the request to another replica? See the module's docstring for why these cases."""
    if isinstance(error, NotConnected):
        return True
    return isinstance(error, Broken) and not still_routable


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
        except Silent as exc:
            balancer.release(candidate)
            raise ReplicaTimeout(candidate, conf.upstream_timeout()) from exc
        except UpstreamError as exc:
            balancer.release(candidate)
            error = exc
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
    connection = http.client.HTTPConnection(
        candidate.address, candidate.port, timeout=CONNECT_TIMEOUT_SECONDS
    )
    try:
        connection.connect()
    except OSError as exc:
        connection.close()
        raise NotConnected(f"cannot connect: {exc}") from exc
    try:
        assert connection.sock is not None
        connection.sock.settimeout(conf.upstream_timeout())
        connection.request(
            "POST",
            path,
            body=payload,
            headers={"Content-Type": "application/json", "Connection": "close"},
        )
        response = connection.getresponse()
        content_type = response.getheader("Content-Type") or "application/json"
        if stream and response.status == 200:
            chunks = _chunks(response)
            # The first chunk comes once the engine has started on this request: reading
            # it here means a replica that goes away while the request waits in its queue
            # can still be retried, before the client has been sent anything.
            first = next(chunks, b"")
            return Answer(candidate, 200, content_type, connection, first=first, rest=chunks)
        body = response.read()
    except TimeoutError as exc:
        connection.close()
        raise Silent(str(exc)) from exc
    except (OSError, http.client.HTTPException) as exc:
        connection.close()
        raise Broken(f"{type(exc).__name__}: {exc}") from exc
    except BaseException:
        connection.close()
        raise
    connection.close()
    return Answer(candidate, response.status, content_type, connection, body=body)


def _chunks(response: http.client.HTTPResponse) -> Generator[bytes, None, None]:
    """The body as it arrives: one HTTP chunk at a time (engines stream with chunked
    encoding), or whatever has arrived when the body is not chunked."""
    while chunk := response.read1(READ_BYTES):
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
