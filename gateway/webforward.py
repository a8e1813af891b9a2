"""Everything that is not /v1/ or /metrics: passed to the web process (console, admin, /api/v1/,
/mirror/) when LLMGW_GATEWAY_FORWARD_TO names it, so that one address serves both.

A request's body is read whole before it is passed on (a slow client then never holds a web
thread), within the web's own limit and this process's budget of bytes held for it; the web's
answer comes back as it comes, a file of weights included.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from core import requestid

from . import conf, errors, http, proxy
from .forwarded import GATEWAY_SECRET_HEADER, gateway_secret
from .http import Receive, Scope, Send
from .metrics import Metrics

log = logging.getLogger("llmgw.gateway")

HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
}

# Headers by which a client would say who it is or how it came: only the gateway tells the web
# that, from the peer it saw (or a trusted proxy's word, see LLMGW_TRUSTED_PROXIES), so a
# client's own are dropped. So is every name with an underscore: Django's WSGI environ cannot
# tell X_Forwarded_For from X-Forwarded-For, and gunicorn takes a SCRIPT_NAME header as the
# script prefix.
CLIENT_MAY_NOT_SAY = {
    b"expect",  # the gateway has read the body already: the web must not answer 100 Continue
    b"forwarded",
    b"x-real-ip",
    b"x-client-ip",
    b"true-client-ip",
    b"x-url-scheme",
    b"front-end-https",
    GATEWAY_SECRET_HEADER.lower().encode(),
    # The gateway's choice is sent instead (the client's own only when sane, core.requestid),
    # and the web's answer gets it back from gateway.http.start.
    b"x-request-id",
}


def forwarded_headers(scope: Scope) -> list[tuple[str, str]]:
    """The headers the web process gets: the client's, less hop-by-hop ones and any that say
    who the client is, plus the gateway's own word on that and the request's ID."""
    headers = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in scope["headers"]
        if k not in HOP_BY_HOP
        and k not in CLIENT_MAY_NOT_SAY
        and not k.startswith(b"x-forwarded-")
        and b"_" not in k
    ]
    client = scope.get("client")
    if client:
        headers.append(("X-Forwarded-For", str(client[0])))
    headers.append(("X-Forwarded-Proto", scope.get("scheme", "http")))
    headers.append((requestid.HEADER, requestid.now()))
    secret = gateway_secret()
    if secret:
        headers.append((GATEWAY_SECRET_HEADER, secret))
    return headers


# Connections to the web process a gateway process opens at most; requests beyond them wait in
# the gateway (their bodies already read, within the forward budget). The web serves 16 at once
# (gunicorn's 2 workers x 8 threads in the run command), so 32 a gateway process keep it busy,
# while a burst (thousands of nodes reporting at once) no longer opens a connection per request
# until gunicorn stops accepting and connections time out in its backlog.
WEB_CONNECTIONS = 32


class Web:
    """Pooled connections to the web process."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=WEB_CONNECTIONS, keepalive_timeout=proxy.IDLE_SECONDS
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class Budget:
    """Bytes of request bodies for the web held in this process, all clients together: a body
    is read whole before it is passed on (a slow client then never holds a web thread), so
    this bounds what clients not yet known can pin."""

    def __init__(self, board: Metrics) -> None:
        self.held = 0
        self._board = board

    def take(self, size: int) -> Callable[[], None] | None:
        """Hold `size` bytes; None when there is no room. Returns what gives them back (once,
        however often it is called)."""
        if self.held + size > conf.forward_memory_bytes():
            return None
        self.held += size
        self._board.forward_held.inc(size)
        given = False

        def give() -> None:
            nonlocal given
            if not given:
                given = True
                self.held -= size
                self._board.forward_held.dec(size)

        return give


async def _read_forwarded_body(receive: Receive, send: Send, limit: int) -> bytes | None:
    """The request's body, at most `limit` bytes; None when the client was answered instead
    (413, 408) or went away."""
    try:
        return await http.read_body(receive, limit)
    except http.TooBig:
        await http.refuse(send, errors.too_large(limit))
    except http.Slow:
        await http.refuse(send, errors.too_slow(conf.body_seconds()))
    except http.Disconnected:
        pass
    return None


async def forward(web: Web, budget: Budget, scope: Scope, receive: Receive, send: Send) -> None:
    """Pass the request to the web process over `web`'s connections, its body read whole first
    (within the web's limit and the process's `budget`), and its answer back as it comes."""
    target = conf.forward_to()
    if target is None:
        await http.refuse(
            send,
            errors.openai_error(
                404,
                "This address serves the gateway only (/v1/ and /metrics).",
                code="unknown_url",
            ),
        )
        return
    limit = conf.max_body_bytes()  # what the web takes: more would only be refused there
    declared = http.header(scope, b"content-length")
    if declared.isdigit() and int(declared) > limit:
        await http.refuse(send, errors.too_large(limit))
        return
    # Held from before the read until the web has the body: the declared length, or the
    # limit when the body comes in chunks of unknown total.
    if declared.isdigit():
        held = int(declared)
    else:
        held = limit if http.header(scope, b"transfer-encoding") else 0
    give_back = budget.take(held)
    if give_back is None:
        await http.refuse(send, errors.busy(1))
        return
    try:
        await _forward_held(web, scope, receive, send, target, limit, give_back)
    finally:
        give_back()


async def _forward_held(
    web: Web,
    scope: Scope,
    receive: Receive,
    send: Send,
    target: str,
    limit: int,
    give_back: Callable[[], None],
) -> None:
    body = await _read_forwarded_body(receive, send, limit)
    if body is None:
        return
    headers = forwarded_headers(scope)
    url = target + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    try:
        response = await web.session().request(
            scope["method"],
            URL(url, encoded=True),
            data=body or None,
            headers=CIMultiDict(headers),
            allow_redirects=False,
        )
    except (aiohttp.ClientError, OSError) as exc:
        give_back()
        log.warning("gateway: the web process did not answer: %s", exc)
        await http.refuse(
            send,
            errors.openai_error(
                502,
                "The web process behind the gateway did not answer; try again in a moment.",
                code="web_unreachable",
                kind="server_error",
            ),
        )
        return
    give_back()  # the web has the body: an answer streamed back holds none of it
    try:
        await http.start(
            send,
            response.status,
            (
                (k.lower(), v)
                for k, v in response.raw_headers
                if k.lower() not in HOP_BY_HOP and k.lower() != b"x-request-id"
            ),
        )

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, OSError):
                if not response.closed:
                    raise

        await http.pump(chunks(), send, receive, response.close)
    finally:
        response.close()
