"""The gateway's settings: a Django setting when the site defines one, else the environment.

Each is read when used (not at import), so tests and a changed settings module take effect
without a restart of the module. Those every request reads (`@per_request`) are read once and
kept until a Django setting changes (a test's override sends `setting_changed`): a read costs a
few microseconds (a missing setting is an AttributeError inside Django's LazySettings, then the
environment), and a request reads ten of them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from django.conf import settings
from django.core.signals import setting_changed

from core.env import EnvError, parse_bool, parse_number

T = TypeVar("T")
# What the per-request settings were read as; a handful of entries, one per function below.
_kept: dict[str, Any] = {}


def per_request(read: Callable[[], T]) -> Callable[[], T]:
    """`read`, remembered after its first answer until a Django setting changes. A value that
    cannot be read (an EnvError) is not remembered: each use says so."""
    name = read.__qualname__

    @functools.wraps(read)
    def kept() -> T:
        try:
            return _kept[name]
        except KeyError:
            value = _kept[name] = read()
            return value

    return kept


def _forget(**_: object) -> None:
    _kept.clear()


setting_changed.connect(_forget, dispatch_uid="llmgw.gateway.conf")


def _number(name: str, default: float, *, minimum: float) -> float:
    configured = getattr(settings, name, None)
    raw: object = configured if configured is not None else os.environ.get(name)
    if raw is None or raw == "":
        return default
    return parse_number(name, raw, minimum=minimum)


@per_request
def wait_seconds() -> float:
    """How long a request waits for a replica that is being started (on demand, or being placed)."""
    return _number("LLMGW_GATEWAY_WAIT", 60, minimum=0)


@per_request
def upstream_timeout() -> float:
    """How long a replica may stay silent before the request fails.

    Generous: an engine serves one request at a time, so a request may sit in its
    queue behind others before the first byte comes.
    """
    return _number("LLMGW_GATEWAY_UPSTREAM_TIMEOUT", 600, minimum=1)


def metrics_dir() -> str | None:
    """The folder shared by the web's worker processes for their metrics; None = this process only."""
    configured = getattr(settings, "LLMGW_METRICS_DIR", None)
    return str(configured) if configured else os.environ.get("LLMGW_METRICS_DIR") or None


def _flag(name: str) -> bool:
    configured = getattr(settings, name, None)
    raw: object = configured if configured is not None else os.environ.get(name)
    if raw is None or raw == "" or isinstance(raw, bool):
        return bool(raw)
    return parse_bool(name, str(raw))


def gc_freeze() -> bool:
    """Whether a gateway worker, once started, freezes what its start made out of the garbage
    collector's sight and makes its collections seldom (gateway.process.Gateway.started); on by
    default. The test suite turns it off for the gateways it serves inside its own process."""
    configured = getattr(settings, "LLMGW_GATEWAY_GC_FREEZE", None)
    raw = configured if configured is not None else os.environ.get("LLMGW_GATEWAY_GC_FREEZE")
    if raw is None or raw == "":
        return True
    return _flag("LLMGW_GATEWAY_GC_FREEZE")


def metrics_token() -> str | None:
    """The token a Prometheus scrape sends (Authorization: Bearer …) to read /metrics."""
    configured = getattr(settings, "LLMGW_METRICS_TOKEN", None)
    return str(configured) if configured else os.environ.get("LLMGW_METRICS_TOKEN") or None


def metrics_open() -> bool:
    """/metrics without a token, for anyone who can reach it (say, on a private network)."""
    return _flag("LLMGW_METRICS_OPEN")


def forward_to() -> str | None:
    """Where the gateway sends every request that is not /v1/ or /metrics: the web process."""
    configured = getattr(settings, "LLMGW_GATEWAY_FORWARD_TO", None)
    raw = str(configured) if configured else os.environ.get("LLMGW_GATEWAY_FORWARD_TO") or ""
    return raw.rstrip("/") or None


@per_request
def max_body_bytes() -> int:
    return int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 1024 * 1024)


# -- what a connection may cost before anything is known about its client (gateway.protocol) --


def max_head_bytes() -> int:
    """A request's line and header fields, in bytes, together (431 above): nginx's default
    buffers hold 32 KiB; an OpenAI client sends under 1 KiB."""
    return int(_number("LLMGW_GATEWAY_MAX_HEAD_BYTES", 32 * 1024, minimum=1024))


def max_headers() -> int:
    """Header fields in one request (431 above), as Python's http.client allows."""
    return int(_number("LLMGW_GATEWAY_MAX_HEADERS", 100, minimum=8))


def head_seconds() -> float:
    """How long a request's head may take to arrive whole (408 after)."""
    return _number("LLMGW_GATEWAY_HEAD_TIMEOUT", 10, minimum=0.1)


def max_connections() -> int:
    """Connections one gateway process keeps open at once; one more is closed unread."""
    return int(_number("LLMGW_GATEWAY_MAX_CONNECTIONS", 4096, minimum=16))


@per_request
def body_seconds() -> float:
    """How long a request body may pause between two of its pieces (408 after)."""
    return _number("LLMGW_GATEWAY_BODY_TIMEOUT", 30, minimum=0.1)


def forward_memory_bytes() -> int:
    """Request bodies for the web process held by one gateway process at once, all clients
    together: a body is held whole before it is passed on (so a slow client never holds a web
    thread), each byte counted as it arrives; a body that finds no room is answered 503."""
    return int(_number("LLMGW_GATEWAY_FORWARD_MEMORY", 64 * 1024 * 1024, minimum=1024 * 1024))


def forward_reserve_bytes() -> int:
    """Of forward_memory_bytes(), what only nodes' reports and small bodies (logins, API writes)
    may fill, so that big uploads, however many, never shut them out; at most half of it."""
    reserve = int(_number("LLMGW_GATEWAY_FORWARD_RESERVE", 8 * 1024 * 1024, minimum=0))
    return min(reserve, forward_memory_bytes() // 2)


def forward_client_bytes() -> int:
    """Of forward_memory_bytes(), what the bodies of one client address may hold at once (an
    IPv6 address with its /64): a few addresses cannot fill it for everyone. Nodes' reports
    are not counted (the node gate bounds them)."""
    return int(_number("LLMGW_GATEWAY_FORWARD_PER_CLIENT", 4 * 1024 * 1024, minimum=64 * 1024))


def body_deadline() -> float:
    """How long a request body for the web process may take to arrive whole (408 after),
    however steadily it comes."""
    return _number("LLMGW_GATEWAY_BODY_DEADLINE", 60, minimum=1)


def body_min_rate() -> float:
    """Bytes a second a request body for the web process must average once its first
    seconds are over (408 below; 0: no such floor): one trickling a byte now and then is cut
    off long before its deadline."""
    return _number("LLMGW_GATEWAY_BODY_MIN_RATE", 1024, minimum=0)


def trusted_proxies() -> list[str]:
    """Addresses (or networks) of proxies in front of the gateway whose X-Forwarded-For and
    X-Forwarded-Proto are believed; none by default: the client is the peer the gateway sees."""
    configured = getattr(settings, "LLMGW_TRUSTED_PROXIES", None)
    raw = str(configured) if configured else os.environ.get("LLMGW_TRUSTED_PROXIES") or ""
    return [part.strip() for part in raw.split(",") if part.strip()]


# -- fair queueing when a model's slots are all busy (gateway.fairqueue) --


@per_request
def fair_queue_on() -> bool:
    """Whether a request waits in the gateway, in fair order between keys, when every slot of its
    model is busy (the default); off sends it on at once, to wait in the engine's own
    first-come queue, where one key's flood holds up every other key."""
    configured = getattr(settings, "LLMGW_FAIR_QUEUE", None)
    raw = configured if configured is not None else os.environ.get("LLMGW_FAIR_QUEUE")
    if raw is None or raw == "":
        return True
    return _flag("LLMGW_FAIR_QUEUE")


@per_request
def queue_timeout() -> float:
    """Seconds a request may wait in the gateway's queue for a free slot (then 503 with
    Retry-After). Counted from when it starts waiting, apart from LLMGW_GATEWAY_WAIT (a replica
    being started) and the upstream timeout (an engine's silence once the request is sent)."""
    return _number("LLMGW_QUEUE_TIMEOUT", 60, minimum=0)


def limits_redis_url() -> str | None:
    """Where keys' and teams' rates are counted over several gateway machines
    (gateway.redislimits): LLMGW_LIMITS_REDIS, else REDIS_URL; "off", or neither set: each
    machine counts alone."""
    configured = getattr(settings, "LLMGW_LIMITS_REDIS", None)
    raw = str(configured) if configured else os.environ.get("LLMGW_LIMITS_REDIS") or ""
    if raw.strip().lower() in {"off", "no", "false", "0"}:
        return None
    url = raw.strip() or str(getattr(settings, "REDIS_URL", "") or "")
    if url and not url.startswith(("redis://", "rediss://", "unix://")):
        raise EnvError(
            f"LLMGW_LIMITS_REDIS={raw!r} is not a Redis URL: write redis://HOST:PORT/DB, or off."
        )
    return url or None


@per_request
def limits_redis_timeout() -> float:
    """How long a request waits for Redis's word on its limits (gateway.redislimits) before the
    fallback decides it (LLMGW_LIMITS_REDIS_FALLBACK), and Redis is left alone a few seconds."""
    return _number("LLMGW_LIMITS_REDIS_TIMEOUT", 0.25, minimum=0.01)


def limits_redis_fallback() -> str:
    """What decides the requests Redis would count while it cannot be reached: "alone" (each
    machine by its own counts: a limit can be passed once per machine) or "refuse" (503: no
    limit is ever passed, and limited keys wait for Redis)."""
    configured = getattr(settings, "LLMGW_LIMITS_REDIS_FALLBACK", None)
    raw = str(configured) if configured else os.environ.get("LLMGW_LIMITS_REDIS_FALLBACK") or ""
    value = raw.strip().lower() or "alone"
    if value not in ("alone", "refuse"):
        raise EnvError(
            f"LLMGW_LIMITS_REDIS_FALLBACK={raw!r} is not a fallback: write alone (each machine "
            "counts alone while Redis cannot be reached) or refuse (limited requests are refused)."
        )
    return value


@per_request
def queue_max() -> int:
    """Requests that may wait for a free slot of one model on this machine, all gateway processes
    together (one more gets 429 at once); 0: none waits, a request finding every slot busy gets
    429."""
    return int(_number("LLMGW_QUEUE_MAX", 1000, minimum=0))


@per_request
def queue_max_per_user() -> int:
    """Of LLMGW_QUEUE_MAX, the requests of one person's keys that may wait (a quarter of it by
    default): one person cannot fill a model's queue and turn everyone else away."""
    return int(_number("LLMGW_QUEUE_MAX_PER_USER", queue_max() // 4, minimum=0))


@per_request
def queue_max_per_key() -> int:
    """Of those, the requests of one key that may wait (as many as its owner's by default)."""
    return int(_number("LLMGW_QUEUE_MAX_PER_KEY", queue_max_per_user(), minimum=0))


# -- the access log: one line per /v1/ request (gateway.accesslog) --

ACCESS_LOG_FORMATS = ("text", "json", "off")


def access_log_format() -> str:
    """What the access log's lines are: "text" (key=value words, for people and grep), "json"
    (one object a line, for machines) or "off" (no access log)."""
    configured = getattr(settings, "LLMGW_ACCESS_LOG", None)
    raw = str(configured) if configured else os.environ.get("LLMGW_ACCESS_LOG") or ""
    value = raw.strip().lower() or "text"
    if value not in ACCESS_LOG_FORMATS:
        raise EnvError(
            f"LLMGW_ACCESS_LOG={raw!r} is not an access log format: write text (the default, "
            "key=value words), json (one object a line) or off (no access log)."
        )
    return value


def access_log_file() -> Path:
    """The access log's file, shared by the machine's gateway processes: LLMGW_VAR_DIR's
    log/gateway-access.log (beside the run command's other logs) unless LLMGW_ACCESS_LOG_FILE
    names another; a relative path is taken from the checkout."""
    configured = getattr(settings, "LLMGW_ACCESS_LOG_FILE", None)
    raw = str(configured) if configured else os.environ.get("LLMGW_ACCESS_LOG_FILE") or ""
    if not raw.strip():
        return Path(settings.VAR_DIR) / "log" / "gateway-access.log"
    path = Path(raw.strip())
    if raw.strip().endswith("/") or (path.exists() and path.is_dir()):
        raise EnvError(
            f"LLMGW_ACCESS_LOG_FILE={raw!r} is a folder: name the file, like "
            f"{path / 'gateway-access.log'}."
        )
    return path if path.is_absolute() else Path(settings.BASE_DIR) / path


def access_log_max_bytes() -> int:
    """The size at which the access log is rotated (to .1, .1 to .2, …); 0: never, for a
    logrotate of your own (each process reopens the file once it is moved away)."""
    return int(_number("LLMGW_ACCESS_LOG_MAX_BYTES", 100 * 1024 * 1024, minimum=0))


def access_log_backups() -> int:
    """Rotated access logs kept (.1 the newest); the oldest is removed at the next rotation."""
    return int(_number("LLMGW_ACCESS_LOG_BACKUPS", 5, minimum=1))


# -- images (gateway.images) ----------------------------------------------------------------


def image_hosts() -> tuple[str, ...]:
    """The hosts a request's remote image URL may name, which the gateway fetches the image
    from itself (comma-separated, as in LLMGW_SOURCE_ALLOWED_HOSTS: host, host:port, *.domain);
    none by default: images come inline, as data URLs."""
    from core.outbound import HostSyntaxError, parse_allowed_hosts

    configured = getattr(settings, "LLMGW_GATEWAY_IMAGE_HOSTS", None)
    raw = configured if configured is not None else os.environ.get("LLMGW_GATEWAY_IMAGE_HOSTS", "")
    entries = tuple(
        entry.strip()
        for entry in (raw.split(",") if isinstance(raw, str) else list(raw))
        if entry.strip()
    )
    try:
        parse_allowed_hosts(entries)
    except HostSyntaxError as exc:
        raise EnvError(f"LLMGW_GATEWAY_IMAGE_HOSTS: {exc}") from None
    return entries


def image_fetch_seconds() -> float:
    """How long the gateway waits for one remote image, all of it."""
    return _number("LLMGW_GATEWAY_IMAGE_SECONDS", 10, minimum=0.1)
