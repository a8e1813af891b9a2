"""Which hosts the control plane may fetch from, checked on every request it makes.

Sources people give (a model's or adapter's, `plan`, memory estimates) and the registry are all
fetched through here, so that none can be used to reach an internal address: the URL must be
plain (parse_target), its host on the allow-list (HostPolicy), and so must every redirect hop
(GuardedAdapter, httpx_request_hook). Names are compared as written, not resolved: an allowed
name reaches whatever it resolves to, which is what allowing it means.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.util import parse_url

DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_REDIRECTS = 5
# Where huggingface.co sends downloads (LFS and Xet storage); allowed with it by default.
HUGGING_FACE = "huggingface.co"
HUGGING_FACE_DOWNLOAD_HOSTS = ("*.huggingface.co", "*.hf.co")

_LABEL = r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?"
_AUTHORITY = re.compile(
    rf"(?P<name>{_LABEL}(?:\.{_LABEL})*)|\[(?P<v6>[0-9a-f:.]+)\](?::(?P<v6port>[0-9]{{1,5}}))?",
    re.IGNORECASE,
)
_NAME_PORT = re.compile(rf"(?P<name>{_LABEL}(?:\.{_LABEL})*):(?P<port>[0-9]{{1,5}})", re.IGNORECASE)
_NUMERIC_LABEL = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)", re.IGNORECASE)


class URLRefused(requests.exceptions.InvalidURL):
    """A URL the control plane will not fetch; the message says why, in a full sentence.

    A requests exception, so that a caller handling "could not fetch" handles this too.
    """

    def __init__(self, message: str, *, url: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.code = code

    def __str__(self) -> str:
        return self.message


class HostSyntaxError(ValueError):
    """An allow-list entry or a URL's host that is not written plainly."""


@dataclass(frozen=True)
class Target:
    """Where a URL sends a request: scheme, host (lowercase; IPv6 compressed) and port."""

    scheme: str
    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _host(text: str) -> str:
    """A host as compared: lowercase, IPv4 in dotted decimal only, IPv6 compressed."""
    if ":" in text:
        try:
            return ipaddress.IPv6Address(text).compressed
        except ValueError:
            raise HostSyntaxError(f"{text!r} is not an IPv6 address") from None
    host = text.lower()
    if _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
        # A host ending in a number is an IPv4 address to every resolver, which
        # also reads 127.1, 0x7f.0.0.1 and 2130706433 as 127.0.0.1.
        try:
            canonical = str(ipaddress.IPv4Address(host))
        except ValueError:
            canonical = ""
        if canonical != host:
            raise HostSyntaxError(
                f"{text!r} is an IP address written in an unusual form; write it as four "
                "decimal numbers, like 127.0.0.1"
            )
    return host


def _port(text: str | None) -> int | None:
    if text is None:
        return None
    port = int(text)
    if not 0 < port < 65536:
        raise HostSyntaxError(f"{text} is not a port (1 to 65535)")
    return port


def parse_target(url: str) -> Target:
    """Where `url` sends a request; URLRefused, before anything is sent, when it is not plain:
    a scheme other than http or https; a user name or password before the host; a backslash
    anywhere; spaces, control or non-ASCII characters; a percent sign, empty label or trailing
    dot in the host; an IPv4 address in any form but dotted decimal (`127.1`, `0x7f.0.0.1`,
    `2130706433`); an IPv6 zone; an empty or out-of-range port; and any URL for which Python's
    URL parser, urllib3's (requests) and httpx's would name different hosts or ports."""

    def refuse(why: str) -> URLRefused:
        # A password before the host is not repeated in a message that may be logged.
        shown = re.sub(r"(//)[^/?#]*@", r"\1…@", url) if isinstance(url, str) else url
        return URLRefused(
            f"The control plane does not fetch {shown!r}: {why}.",
            url=shown,
            code="source_url_refused",
        )

    if not isinstance(url, str) or not url:
        raise refuse("it is not a URL")
    if any(not 0x21 <= ord(c) <= 0x7E for c in url):
        raise refuse(
            "it contains a space, a control character or a non-ASCII character; "
            "percent-encode them in the path, and write the host in ASCII (punycode)"
        )
    if "\\" in url:
        raise refuse("it contains a backslash, which some URL parsers read as '/' and others not")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise refuse("only http and https URLs are fetched")
    authority = parts.netloc
    if "@" in authority:
        raise refuse(
            "it has a user name or password before the host (user@host); the control plane "
            "sends no credentials in URLs, so write the URL without them"
        )
    match = _AUTHORITY.fullmatch(authority) or _NAME_PORT.fullmatch(authority)
    if match is None:
        raise refuse(
            f"its host {authority!r} is not written plainly (a name, an IPv4 address, or an "
            "IPv6 address in brackets, then optionally ':' and a port; no '%', empty labels "
            "or trailing dot)"
        )
    groups = match.groupdict()
    try:
        host = _host(groups.get("v6") or groups["name"])
        port = _port(groups.get("v6port") or groups.get("port")) or DEFAULT_PORTS[scheme]
    except HostSyntaxError as exc:
        raise refuse(str(exc)) from None
    target = Target(scheme, host, port)
    # The same URL as the other parsers on the way read it: any disagreement is an ambiguity.
    try:
        theirs = parse_url(url)
        readings = {
            (_host(parts.hostname or ""), parts.port or DEFAULT_PORTS[scheme]),
            (_host((theirs.host or "").strip("[]")), theirs.port or DEFAULT_PORTS[scheme]),
        }
    except ValueError as exc:
        raise refuse(f"it cannot be parsed ({exc})") from None
    if readings != {(target.host, target.port)}:
        raise refuse("URL parsers disagree on which host it names")
    return target


@dataclass(frozen=True)
class AllowedHost:
    """One allow-list entry: a host (or `*.domain`) and a port, None for any port."""

    host: str
    port: int | None = None
    wildcard: bool = False

    @classmethod
    def parse(cls, entry: str) -> AllowedHost:
        text = entry.strip()
        wildcard = text.startswith("*.")
        if wildcard:
            text = text[2:]
        if "/" in text or "@" in text:
            raise HostSyntaxError(
                f"{entry!r} is not a host: write host, host:port, [IPv6]:port or *.domain, "
                "without scheme or path"
            )
        if text.count(":") >= 2 and not text.startswith("["):
            text = f"[{text}]"  # a bare IPv6 address: any port
        match = _AUTHORITY.fullmatch(text) or _NAME_PORT.fullmatch(text)
        if match is None or (wildcard and match.groupdict().get("v6")):
            raise HostSyntaxError(
                f"{entry!r} is not a host: write host, host:port, [IPv6]:port or *.domain "
                "(no '%', empty labels or trailing dot)"
            )
        groups = match.groupdict()
        return cls(
            host=_host(groups.get("v6") or groups["name"]),
            port=_port(groups.get("v6port") or groups.get("port")),
            wildcard=wildcard,
        )

    def matches(self, target: Target) -> bool:
        if self.port is not None and self.port != target.port:
            return False
        if self.wildcard:
            return target.host.endswith(f".{self.host}")
        return target.host == self.host


def parse_allowed_hosts(entries: tuple[str, ...] | list[str]) -> tuple[AllowedHost, ...]:
    return tuple(AllowedHost.parse(entry) for entry in entries)


def endpoint_hosts(endpoint: str) -> tuple[str, ...]:
    """The allow-list entries a registry endpoint brings: its host, and huggingface.co's downloads."""
    parts = urlsplit(endpoint)
    if not parts.hostname:
        return ()
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    entries = [f"{host}:{parts.port}" if parts.port else host]
    if parts.hostname.lower() in (HUGGING_FACE, f"www.{HUGGING_FACE}"):
        entries.extend(HUGGING_FACE_DOWNLOAD_HOSTS)
    return tuple(entries)


@dataclass(frozen=True)
class HostPolicy:
    """The allow-list in force and where it was set, for refusals that say where to change it.

    A host, with its port (the scheme's default when none is written), must match an entry of
    `sources.allowed_hosts` in server.yaml (or LLMGW_SOURCE_ALLOWED_HOSTS); by default the
    control plane's own host (the mirror) and the registry's. An entry is `host` (any port),
    `host:port`, `[v6]`, `[v6]:port`, or `*.domain`. Registry requests may also go to the
    registry endpoint's host, and for huggingface.co to its download hosts."""

    allowed: tuple[str, ...]
    setting: str = "sources.allowed_hosts in server.yaml (nor LLMGW_SOURCE_ALLOWED_HOSTS)"

    def check(self, url: str) -> Target:
        target = parse_target(url)
        try:
            entries = parse_allowed_hosts(self.allowed)
        except HostSyntaxError as exc:
            raise URLRefused(
                f"The control plane does not fetch {url}: {self.setting} has an entry that is "
                f"not a host ({exc}).",
                url=url,
                code="source_host_not_allowed",
            ) from None
        if not any(entry.matches(target) for entry in entries):
            raise URLRefused(
                f"The control plane may not fetch {url}: {target.address} is not in "
                f"{self.setting}, which now allows {', '.join(self.allowed) or 'no host'}. "
                "Add the host there if it should be reachable.",
                url=url,
                code="source_host_not_allowed",
            )
        return target


class GuardedAdapter(HTTPAdapter):
    """A requests transport that checks every request, redirect hops included, and connects
    to exactly the host and port it checked."""

    def __init__(self, policy: HostPolicy, **kwargs: Any) -> None:
        self.policy = policy
        super().__init__(**kwargs)

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> Any:
        self.policy.check(str(request.url))
        return super().send(request, *args, **kwargs)

    def build_connection_pool_key_attributes(
        self, request: Any, verify: Any, cert: Any = None
    ) -> Any:
        target = self.policy.check(str(request.url))
        host_params, pool_kwargs = super().build_connection_pool_key_attributes(
            request, verify, cert
        )
        # The pool connects to what was checked, whatever requests' own parsing gives.
        host_params = {
            **host_params,
            "scheme": target.scheme,
            "host": target.host,
            "port": target.port,
        }
        return host_params, pool_kwargs


def guarded_session(policy: HostPolicy) -> requests.Session:
    """A requests session that fetches only what `policy` allows, on every hop."""
    session = requests.Session()
    session.max_redirects = MAX_REDIRECTS
    adapter = GuardedAdapter(policy)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def httpx_request_hook(policy_for: Any) -> Any:
    """An httpx request event hook (run for every hop, proxied or not) enforcing a policy.

    `policy_for()` is asked at each request, so a changed configuration takes effect.
    """

    def check(request: Any) -> None:
        target = policy_for().check(str(request.url))
        port = request.url.port or DEFAULT_PORTS.get(request.url.scheme, 0)
        try:
            host = _host(request.url.raw_host.decode("ascii").strip("[]"))
        except (UnicodeDecodeError, HostSyntaxError):
            host = ""
        if (host, port) != (target.host, target.port):
            raise URLRefused(
                f"The control plane does not fetch {request.url}: URL parsers disagree on "
                "which host it names.",
                url=str(request.url),
                code="source_url_refused",
            )

    return check
