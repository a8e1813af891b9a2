"""Everything that is not /v1/ or /metrics: passed to the web process (console, admin, /api/v1/,
/mirror/) when LLMGW_GATEWAY_FORWARD_TO names it, so that one address serves both.

A request's body is read whole before it is passed on (a slow client then never holds a web
thread), within the web's own limit and this process's budget of bytes held for it (`Budget`),
and within a pause limit, a deadline and a minimum rate (http.Pace); the web's answer comes back
as it comes, a file of weights included.

Why the budget counts bytes as they come, not the length a body declares: taking the declared
length before a byte arrived let some 128 anonymous connections, each declaring a megabyte to
POST /login/ and sending a byte every 20 seconds, hold all of it, so that every login, API write
and node's report was answered 503 for as long as they kept trickling.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from core import requestid

from . import conf, errors, http, proxy
from .errors import Refusal
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


# Bodies declaring at most this many bytes may fill the budget's reserve
# (conf.forward_reserve_bytes): a login form or an API write is a few hundred bytes, a model's
# definition a few kilobytes.
SMALL_BODY = 64 * 1024
# What a refusal for want of room tells the client to wait: bodies go through in well under it.
RETRY_SECONDS = 1


class NoRoom(Exception):
    """A body's next bytes found no room in the budget: `reason` (a label of
    llmgw_gateway_forward_refused) and the answer."""

    def __init__(self, reason: str, refusal: Refusal) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refusal = refusal


class Budget:
    """Bytes of request bodies for the web held in this process, all clients together: a body
    is read whole before it is passed on (a slow client then never holds a web thread), so this
    bounds what clients not yet known can pin.

    A body is charged for the bytes that have come, as they come, never for the length it
    declares: a client that declares a megabyte and trickles holds what it sent. Within
    conf.forward_memory_bytes(), big bodies leave its reserve to nodes' reports and small ones,
    and one client address holds at most conf.forward_client_bytes().

    Bounded: `clients` has an entry per address holding bytes now, at most one per open
    connection (llmgw_gateway_forward_clients_entries)."""

    def __init__(self, board: Metrics) -> None:
        # Read once here so that a bad value stops the gateway at its start (Gateway.started
        # makes the budget); each body reads them again, as every setting is read when used.
        conf.forward_reserve_bytes(), conf.forward_client_bytes()
        conf.body_deadline(), conf.body_min_rate()
        self.held = 0
        self.clients: dict[str, int] = {}
        self.board = board

    def hold(self, client: str | None, *, reserve: bool) -> Hold:
        """A body's account: `client` its address's share (None: counted in no share), `reserve`
        whether it may fill the reserve."""
        return Hold(self, client, reserve=reserve)

    def add(self, client: str | None, size: int) -> None:
        """Count `size` more bytes held, in `client`'s share (Hold.take decides whether)."""
        self.held += size
        self.board.forward_held.inc(size)
        if client is not None:
            self.clients[client] = self.clients.get(client, 0) + size
            self.board.forward_clients.set(len(self.clients))

    def remove(self, client: str | None, size: int) -> None:
        """Count `size` bytes given back, from `client`'s share."""
        self.held -= size
        self.board.forward_held.dec(size)
        if client is not None:
            left = self.clients.get(client, 0) - size
            if left > 0:
                self.clients[client] = left
            else:
                self.clients.pop(client, None)
            self.board.forward_clients.set(len(self.clients))


class Hold:
    """The bytes one body holds in the budget: taken as they arrive, given back at once when the
    web has them or the request ends (however often `give` is called)."""

    def __init__(self, budget: Budget, client: str | None, *, reserve: bool) -> None:
        self._budget = budget
        self._client = client
        total = conf.forward_memory_bytes()
        self._ceiling = total if reserve else total - conf.forward_reserve_bytes()
        self._reserve = reserve
        self._share = conf.forward_client_bytes()
        self.size = 0

    def take(self, size: int) -> None:
        """Hold `size` more bytes, or raise NoRoom."""
        budget = self._budget
        if budget.held + size > self._ceiling:
            raise NoRoom("reserve" if self._reserve else "budget", errors.busy(RETRY_SECONDS))
        client = self._client
        if client is not None and budget.clients.get(client, 0) + size > self._share:
            raise NoRoom("client_share", errors.client_busy(self._share, RETRY_SECONDS))
        budget.add(client, size)
        self.size += size

    def give(self) -> None:
        if self.size:
            self._budget.remove(self._client, self.size)
            self.size = 0


def client_share_key(scope: Scope) -> str | None:
    """Whose share a request's body counts in: its client's address, an IPv6 one with its /64
    (a single machine is commonly given a whole /64)."""
    client = scope.get("client")
    if not client:
        return None
    host = str(client[0])
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return host


async def _read_forwarded_body(
    receive: Receive, send: Send, limit: int, hold: Hold, board: Metrics
) -> bytes | None:
    """The request's body, at most `limit` bytes, charged to `hold` as it comes; None when the
    client was answered instead (413, 408, 503) or went away."""
    refusal: Refusal
    try:
        return await http.read_body(
            receive,
            limit,
            pace=http.Pace(conf.body_deadline(), conf.body_min_rate()),
            charge=hold.take,
        )
    except http.TooBig:
        refusal, reason = errors.too_large(limit), "too_large"
    except http.TooSlow as late:
        reason = late.reason
        if late.reason == "deadline":
            refusal = errors.too_slow_overall(conf.body_deadline())
        else:
            refusal = errors.too_slow_rate(conf.body_min_rate())
    except http.Slow:
        refusal, reason = errors.too_slow(conf.body_seconds()), "pause"
    except NoRoom as full:
        refusal, reason = full.refusal, full.reason
    except http.Disconnected:
        return None
    hold.give()
    board.forward_refused.labels(reason).inc()
    extra = []
    if refusal.status in (408, 503) and "Retry-After" not in refusal.headers:
        extra.append((b"retry-after", b"%d" % RETRY_SECONDS))
    if "Connection" not in refusal.headers:
        # The rest of the body is not read: the connection cannot carry another request.
        extra.append((b"connection", b"close"))
    await http.refuse(send, refusal, extra)
    return None


async def forward(
    web: Web, budget: Budget, scope: Scope, receive: Receive, send: Send, *, node: bool = False
) -> None:
    """Pass the request to the web process over `web`'s connections, its body read whole first
    (within the web's limit and the process's `budget`), and its answer back as it comes.

    `node`: the request is a node's report or renewal carrying the token of a node this process
    holds (fleet.renewals.Renewals.from_a_node), which the node gate lets through at most
    NODE_REQUESTS at a time, one a node: its body is held in the reserve, not its client's
    share."""
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
        budget.board.forward_refused.labels("too_large").inc()
        await http.refuse(send, errors.too_large(limit))
        return
    small = declared.isdigit() and int(declared) <= SMALL_BODY
    hold = budget.hold(None if node else client_share_key(scope), reserve=node or small)
    board = budget.board
    try:
        board.forward_reading.inc()
        try:
            body = await _read_forwarded_body(receive, send, limit, hold, board)
        finally:
            board.forward_reading.dec()
        if body is not None:
            await _forward_held(web, scope, receive, send, target, body, hold.give)
    finally:
        hold.give()


async def _forward_held(
    web: Web,
    scope: Scope,
    receive: Receive,
    send: Send,
    target: str,
    body: bytes,
    give_back: Callable[[], None],
) -> None:
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
