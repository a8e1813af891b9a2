"""The provider as llmgw sees it: its discovery document and keys, read once and refreshed, the
two requests of the authorization code flow, and the check of an ID token.

Every request goes to the issuer's own scheme, host and port (and the hosts named in
LLMGW_OIDC_ALLOWED_HOSTS), through core.outbound's guarded session, never following a
redirect, with a timeout, and reading at most MAX_DOCUMENT_BYTES of an answer: a discovery
document that names another host, or an answer that redirects, is refused rather than
followed, so a provider's (or an attacker's) document cannot point the control plane at an
internal address.

An ID token is accepted only when signed with an asymmetric algorithm that the provider
advertises, by a key of its JWKS picked by the token's `kid` (a key in the token's own header
is never used), and when its issuer, audience, expiry and nonce are the ones expected. A nonce
is spent in the database when its token is accepted, so the same token is never taken twice,
even by two web processes at once.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import logging
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeGuard
from urllib.parse import quote_plus, urlencode, urlsplit

import requests
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from joserfc import jws
from joserfc.errors import JoseError
from joserfc.jwk import JWKRegistry, Key

from core.jsontext import JSONRefused, loads
from core.outbound import HostPolicy, URLRefused, endpoint_hosts, guarded_session, parse_target
from core.refusals import Refused

log = logging.getLogger("llmgw.signin")

# The asymmetric signature algorithms, with the key type each needs. HS256/384/512 are left
# out on purpose: their "key" would be the client secret, or, in the classic confusion, the
# provider's public key read as a secret; "none" is no signature at all.
ASYMMETRIC = {
    "RS256": "RSA",
    "RS384": "RSA",
    "RS512": "RSA",
    "PS256": "RSA",
    "PS384": "RSA",
    "PS512": "RSA",
    "ES256": "EC",
    "ES384": "EC",
    "ES512": "EC",
    "EdDSA": "OKP",
    "Ed25519": "OKP",
}
# OpenID Connect Discovery: RS256 is what a provider uses when its document names none.
DEFAULT_ALGORITHMS = ("RS256",)
# Discovery documents and JWKS are a few KB; token answers less. Far more is an attack.
MAX_DOCUMENT_BYTES = 256 * 1024
MAX_TOKEN_CHARS = 64 * 1024
TIMEOUT_SECONDS = 10
# The discovery document and the keys are read again after this long, whatever happens.
MAX_AGE_SECONDS = 3600
# A token signed by a key the cached JWKS lacks makes one refresh (the provider may have
# rotated its keys), at most this often: tokens with made-up kids must not make a request each.
UNKNOWN_KID_REFRESH_SECONDS = 10
# The clock difference allowed between the provider and llmgw on exp, iat and nbf.
LEEWAY_SECONDS = 60
# How long a spent nonce is remembered: longer than any ID token it came in is accepted.
SPENT_NONCE_DAYS = 2


class ProviderUnavailable(Refused):
    """The provider could not be asked, or answered something llmgw does not take."""

    def __init__(self, message: str, code: str = "provider_unavailable") -> None:
        super().__init__(message, code=code, status=502)


def refused_token(why: str, code: str) -> Refused:
    """A sign-in that is not taken: `why` completes "The sign-in was refused: "."""
    return Refused(
        f"The sign-in was refused: {why}. Nothing was changed; start again from the login page.",
        code=code,
        status=400,
    )


# -- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ProviderConfig:
    """What the settings say about the provider (see docs/signin.md)."""

    issuer: str
    client_id: str
    secret_file: str
    scopes: tuple[str, ...]
    groups_claim: str
    allowed_hosts: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls) -> ProviderConfig | None:
        """The configured provider, or None when sign-in through a provider is off."""
        issuer = settings.LLMGW_OIDC_ISSUER.strip()
        if not issuer:
            return None
        return cls(
            issuer=issuer,
            client_id=settings.LLMGW_OIDC_CLIENT_ID.strip(),
            secret_file=settings.LLMGW_OIDC_CLIENT_SECRET_FILE.strip(),
            scopes=tuple(settings.LLMGW_OIDC_SCOPES.split()),
            groups_claim=settings.LLMGW_OIDC_GROUPS_CLAIM.strip(),
            allowed_hosts=tuple(settings.LLMGW_OIDC_ALLOWED_HOSTS),
        )

    def problems(self) -> list[str]:
        """What keeps this configuration from working; checked when a process starts."""
        found = []
        try:
            target = parse_target(self.issuer)
        except URLRefused as exc:
            return [f"LLMGW_OIDC_ISSUER={self.issuer!r} is not a URL llmgw will ask: {exc}"]
        if target.scheme != "https" and not _loopback(target.host):
            found.append(
                f"LLMGW_OIDC_ISSUER={self.issuer!r} is not https: a provider is asked over "
                "TLS (plain http only on this machine's own addresses, for tests)"
            )
        if not self.client_id:
            found.append("LLMGW_OIDC_CLIENT_ID is empty: set the client id the provider gave")
        if "openid" not in self.scopes:
            found.append(f"LLMGW_OIDC_SCOPES={' '.join(self.scopes)!r} lacks openid")
        if not self.groups_claim:
            found.append("LLMGW_OIDC_GROUPS_CLAIM is empty: name the claim that holds groups")
        try:
            read_client_secret(self.secret_file)
        except Refused as exc:
            found.append(exc.message)
        return found

    @property
    def discovery_url(self) -> str:
        return f"{self.issuer.rstrip('/')}/.well-known/openid-configuration"

    def policy(self) -> HostPolicy:
        return HostPolicy(
            (*endpoint_hosts(self.issuer), *self.allowed_hosts),
            setting="LLMGW_OIDC_ISSUER's host (nor in LLMGW_OIDC_ALLOWED_HOSTS)",
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_client_secret(path: str) -> str:
    """The client secret kept in `path`, which only its owner may read.

    A secret readable by the group or by everyone has been shown to more people than it
    should, so it is refused rather than used; the message says how to fix the mode.
    """
    if not path:
        raise Refused(
            "LLMGW_OIDC_CLIENT_SECRET_FILE is empty: name a file holding the client secret "
            "(mode 0600, owned by the account llmgw runs as).",
            code="signin_misconfigured",
        )
    file = Path(path)
    try:
        info = file.stat()
    except OSError as exc:
        raise Refused(
            f"LLMGW_OIDC_CLIENT_SECRET_FILE={path!r} cannot be read ({exc.strerror}).",
            code="signin_misconfigured",
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise Refused(
            f"LLMGW_OIDC_CLIENT_SECRET_FILE={path!r} is not a file.", code="signin_misconfigured"
        )
    if info.st_mode & 0o077 or info.st_uid != os.geteuid():
        raise Refused(
            f"LLMGW_OIDC_CLIENT_SECRET_FILE={path!r} may be read by others (mode "
            f"{stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid}): it must be owned by "
            f"the account llmgw runs as (uid {os.geteuid()}) and readable by it alone. Run "
            f"`chmod 600 {path}` (and chown it), and consider the secret seen: make a new one "
            "at the provider.",
            code="signin_misconfigured",
        )
    secret = file.read_text().strip()
    if not secret:
        raise Refused(
            f"LLMGW_OIDC_CLIENT_SECRET_FILE={path!r} is empty.", code="signin_misconfigured"
        )
    return secret


# -- claims ----------------------------------------------------------------------------------

MAX_GROUPS = 1000
MAX_GROUP_CHARS = 256


@dataclass(frozen=True)
class Claims:
    """What an accepted ID token says about the person, in the fields llmgw uses."""

    issuer: str
    subject: str
    preferred_username: str = ""
    email: str = ""
    name: str = ""
    given_name: str = ""
    family_name: str = ""
    groups: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_token(cls, raw: dict[str, Any], *, groups_claim: str) -> Claims:
        def text(name: str, limit: int = 254) -> str:
            value = raw.get(name)
            return value.strip()[:limit] if isinstance(value, str) else ""

        email = text("email")
        # An address the provider itself says it has not verified is not kept: it is not
        # used to match anyone (only issuer and subject are), but people read it as the user's.
        if raw.get("email_verified") is False:
            email = ""
        return cls(
            issuer=raw["iss"],
            subject=raw["sub"],
            preferred_username=text("preferred_username", 150),
            email=email,
            name=text("name", 300),
            given_name=text("given_name", 150),
            family_name=text("family_name", 150),
            groups=groups_of(raw, groups_claim),
            raw=raw,
        )


def groups_of(raw: dict[str, Any], claim: str) -> tuple[str, ...]:
    """The groups named by `claim`: a claim of that name, else a path through objects
    (`realm_access.roles`, Keycloak's roles). A missing claim is no groups; a claim that is not
    a list of text is refused, since reading it as none could take away what it grants."""
    value: Any = raw.get(claim)
    if value is None and "." in claim:
        value = raw
        for part in claim.split("."):
            value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
        raise refused_token(
            f"the token's {claim!r} claim is not a list of group names", "groups_claim_invalid"
        )
    if len(value) > MAX_GROUPS or any(len(g) > MAX_GROUP_CHARS for g in value):
        raise refused_token(
            f"the token's {claim!r} claim holds more than {MAX_GROUPS} groups or a name longer "
            f"than {MAX_GROUP_CHARS} characters",
            "groups_claim_invalid",
        )
    return tuple(dict.fromkeys(g for g in value if g))


# -- the provider's documents ----------------------------------------------------------------


@dataclass(frozen=True)
class Metadata:
    """The parts of the discovery document llmgw uses, each endpoint checked against the policy."""

    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    algorithms: tuple[str, ...]
    token_auth_methods: tuple[str, ...]
    end_session_endpoint: str = ""
    # RFC 8628's, for `llmgw ctl login` (signin.device); "" where the provider has none.
    device_authorization_endpoint: str = ""


@dataclass
class _Keys:
    by_kid: dict[str | None, list[Key]]
    fetched_at: float


class Provider:
    """One provider's discovery document and keys, kept for MAX_AGE_SECONDS and shared by the
    threads of a process (see provider_for)."""

    def __init__(self, config: ProviderConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._metadata: Metadata | None = None
        self._metadata_at = 0.0
        self._keys: _Keys | None = None

    # Fetching ---------------------------------------------------------------------------

    def fetch_json(self, method: str, url: str, what: str, **kwargs: Any) -> tuple[int, Any]:
        """The status and JSON document of one request to the provider; ProviderUnavailable when
        it cannot be had within the bounds. The secret may be in kwargs; it is never in a message."""
        headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
        try:
            self.config.policy().check(url)
            if urlsplit(url).scheme != urlsplit(self.config.issuer).scheme:
                raise ProviderUnavailable(
                    f"The provider's {what} {url} is not on the issuer's scheme "
                    f"({urlsplit(self.config.issuer).scheme}); llmgw does not ask it.",
                    code="provider_endpoint_refused",
                )
            with guarded_session(self.config.policy()) as session:
                response = session.request(
                    method,
                    url,
                    headers=headers,
                    allow_redirects=False,
                    timeout=TIMEOUT_SECONDS,
                    stream=True,
                    **kwargs,
                )
                with response:
                    if response.is_redirect or 300 <= response.status_code < 400:
                        raise ProviderUnavailable(
                            f"The provider's {what} {url} answered with a redirect "
                            f"({response.status_code}), which llmgw does not follow: set "
                            "LLMGW_OIDC_ISSUER to the address the provider names as its issuer.",
                            code="provider_redirected",
                        )
                    body = bytearray()
                    for chunk in response.iter_content(16 * 1024):
                        body += chunk
                        if len(body) > MAX_DOCUMENT_BYTES:
                            raise ProviderUnavailable(
                                f"The provider's {what} {url} answered more than "
                                f"{MAX_DOCUMENT_BYTES // 1024} KiB, far more than such a "
                                "document holds; it was not read.",
                                code="provider_answer_too_large",
                            )
                    status = response.status_code
        except URLRefused as exc:
            raise ProviderUnavailable(
                f"llmgw does not ask the provider's {what}: {exc.message}",
                code="provider_endpoint_refused",
            ) from None
        except requests.RequestException as exc:
            reason = (
                f"no answer within {TIMEOUT_SECONDS}s"
                if isinstance(exc, requests.Timeout)
                else "nothing answered there"
                if isinstance(exc, requests.ConnectionError)
                else type(exc).__name__
            )
            raise ProviderUnavailable(
                f"The provider's {what} {url} could not be reached ({reason}). Try again "
                "shortly; a break-glass administrator can still log in with a password."
            ) from None
        try:
            document = loads(bytes(body))
        except (ValueError, JSONRefused, RecursionError, UnicodeDecodeError):
            raise ProviderUnavailable(
                f"The provider's {what} {url} answered {status} with something that is not JSON.",
                code="provider_answer_invalid",
            ) from None
        return status, document

    def _get_document(self, url: str, what: str) -> dict[str, Any]:
        status, document = self.fetch_json("GET", url, what)
        if status != 200 or not isinstance(document, dict):
            raise ProviderUnavailable(
                f"The provider's {what} {url} answered {status} without the JSON object "
                "expected; check LLMGW_OIDC_ISSUER.",
                code="provider_answer_invalid",
            )
        return document

    # Discovery --------------------------------------------------------------------------

    def metadata(self) -> Metadata:
        with self._lock:
            if self._metadata is None or time.monotonic() - self._metadata_at > MAX_AGE_SECONDS:
                self._metadata = self._discover()
                self._metadata_at = time.monotonic()
            return self._metadata

    def _discover(self) -> Metadata:
        url = self.config.discovery_url
        document = self._get_document(url, "discovery document")
        if document.get("issuer") != self.config.issuer:
            raise ProviderUnavailable(
                f"The provider at {url} names its issuer {document.get('issuer')!r}, not "
                f"{self.config.issuer!r}: set LLMGW_OIDC_ISSUER to exactly the issuer it names.",
                code="provider_issuer_mismatch",
            )

        def endpoint(name: str, *, required: bool = True) -> str:
            value = document.get(name)
            if not isinstance(value, str) or not value:
                if not required:
                    return ""
                raise ProviderUnavailable(
                    f"The provider's discovery document {url} has no {name}.",
                    code="provider_answer_invalid",
                )
            try:
                self.config.policy().check(value)
            except URLRefused as exc:
                raise ProviderUnavailable(
                    f"The provider's discovery document names {name} {value}, which llmgw does "
                    f"not ask: {exc.message}",
                    code="provider_endpoint_refused",
                ) from None
            if urlsplit(value).scheme != urlsplit(self.config.issuer).scheme:
                raise ProviderUnavailable(
                    f"The provider's {name} {value} is not on the issuer's scheme.",
                    code="provider_endpoint_refused",
                )
            return value

        advertised = document.get("id_token_signing_alg_values_supported")
        if advertised is None:
            advertised = list(DEFAULT_ALGORITHMS)
        algorithms = tuple(a for a in advertised if isinstance(a, str) and a in ASYMMETRIC)
        if not algorithms:
            raise ProviderUnavailable(
                f"The provider signs ID tokens only with {advertised!r}; llmgw takes only "
                f"asymmetric signatures ({', '.join(ASYMMETRIC)}). Configure the client at the "
                "provider to sign with RS256.",
                code="provider_algorithms_refused",
            )
        challenge = document.get("code_challenge_methods_supported")
        if isinstance(challenge, list) and "S256" not in challenge:
            raise ProviderUnavailable(
                f"The provider does not take PKCE with S256 (it names {challenge!r}), which "
                "llmgw always uses.",
                code="provider_pkce_missing",
            )
        methods = document.get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]
        return Metadata(
            authorization_endpoint=endpoint("authorization_endpoint"),
            token_endpoint=endpoint("token_endpoint"),
            jwks_uri=endpoint("jwks_uri"),
            algorithms=algorithms,
            token_auth_methods=tuple(m for m in methods if isinstance(m, str)),
            end_session_endpoint=endpoint("end_session_endpoint", required=False),
            device_authorization_endpoint=endpoint("device_authorization_endpoint", required=False),
        )

    # Keys -------------------------------------------------------------------------------

    def key_for(self, kid: str | None, algorithm: str, metadata: Metadata | None = None) -> Key:
        """The provider's key for a token's kid and algorithm: the JWKS read again when it is
        older than MAX_AGE_SECONDS, or (at most every UNKNOWN_KID_REFRESH_SECONDS) when it lacks
        the kid. Refused when none fits."""
        metadata = metadata or self.metadata()
        with self._lock:
            now = time.monotonic()
            if self._keys is None or now - self._keys.fetched_at > MAX_AGE_SECONDS:
                self._keys = self._read_keys(metadata)
            key = self._pick(kid, algorithm)
            if key is None and now - self._keys.fetched_at > UNKNOWN_KID_REFRESH_SECONDS:
                log.info("signin: key %r not in the provider's JWKS; reading it again", kid)
                self._keys = self._read_keys(metadata)
                key = self._pick(kid, algorithm)
        if key is None:
            raise refused_token(
                f"the token is signed by a key ({kid!r}, {algorithm}) the provider does not "
                "publish",
                "id_token_unknown_key",
            )
        return key

    def _read_keys(self, metadata: Metadata) -> _Keys:
        document = self._get_document(metadata.jwks_uri, "key set (JWKS)")
        entries = document.get("keys")
        by_kid: dict[str | None, list[Key]] = {}
        for entry in entries if isinstance(entries, list) else []:
            # Symmetric keys never verify an ID token here, and keys for encryption are not
            # for signatures.
            if not isinstance(entry, dict) or entry.get("kty") not in ("RSA", "EC", "OKP"):
                continue
            if entry.get("use", "sig") != "sig":
                continue
            try:
                key = JWKRegistry.import_key(entry)
            except (JoseError, ValueError, TypeError):
                continue
            by_kid.setdefault(
                entry.get("kid") if isinstance(entry.get("kid"), str) else None, []
            ).append(key)
        return _Keys(by_kid=by_kid, fetched_at=time.monotonic())

    def _pick(self, kid: str | None, algorithm: str) -> Key | None:
        assert self._keys is not None
        if kid is None:
            # A token without a kid is taken only from a provider with a single key.
            everything = [k for keys in self._keys.by_kid.values() for k in keys]
            candidates = everything if len(everything) == 1 else []
        else:
            candidates = self._keys.by_kid.get(kid, [])
        for key in candidates:
            declared = key.alg
            if key.key_type == ASYMMETRIC[algorithm] and declared in (None, algorithm):
                return key
        return None

    # The flow ---------------------------------------------------------------------------

    def authorization_url(self, *, state: str, nonce: str, verifier: str, redirect_uri: str) -> str:
        query = urlencode(
            {
                "response_type": "code",
                "client_id": self.config.client_id,
                "redirect_uri": redirect_uri,
                "scope": " ".join(self.config.scopes),
                "state": state,
                "nonce": nonce,
                "code_challenge": challenge_of(verifier),
                "code_challenge_method": "S256",
            }
        )
        endpoint = self.metadata().authorization_endpoint
        return f"{endpoint}{'&' if '?' in endpoint else '?'}{query}"

    def exchange_code(self, *, code: str, verifier: str, redirect_uri: str) -> dict[str, Any]:
        """The token endpoint's answer for an authorization code (its id_token not yet checked)."""
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": redirect_uri,
            "code_verifier": verifier,
        }
        return self._token_request(form)

    def refresh(self, refresh_token: str) -> dict[str, Any]:
        """The token endpoint's answer for a refresh token."""
        return self._token_request({"grant_type": "refresh_token", "refresh_token": refresh_token})

    def client_post(self, url: str, what: str, form: dict[str, str]) -> tuple[int, Any]:
        """POST `form` to one of the provider's endpoints as llmgw's client, authenticated the
        way its token endpoint takes: the status and the JSON answer (fetch_json)."""
        methods = self.metadata().token_auth_methods
        secret = read_client_secret(self.config.secret_file)
        auth: Any = None
        if "client_secret_basic" in methods or not methods:
            # RFC 6749 2.3.1: both parts form-encoded before they are joined.
            auth = requests.auth.HTTPBasicAuth(
                _form_encoded(self.config.client_id), _form_encoded(secret)
            )
        else:
            form = {**form, "client_id": self.config.client_id, "client_secret": secret}
        return self.fetch_json("POST", url, what, data=form, auth=auth)

    def _token_request(self, form: dict[str, str]) -> dict[str, Any]:
        status, answer = self.client_post(self.metadata().token_endpoint, "token endpoint", form)
        if status != 200 or not isinstance(answer, dict):
            error = answer.get("error") if isinstance(answer, dict) else None
            if status == 400 and isinstance(error, str):
                raise refused_token(
                    f"the provider would not give tokens for this sign-in ({error[:100]})",
                    "token_exchange_refused",
                )
            raise ProviderUnavailable(
                f"The provider's token endpoint answered {status}; try again shortly.",
                code="provider_answer_invalid",
            )
        return answer


def _form_encoded(text: str) -> str:
    return quote_plus(text)


def challenge_of(verifier: str) -> str:
    """PKCE's S256 challenge of a verifier (RFC 7636 4.2)."""
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def new_secret() -> str:
    """A state, nonce or PKCE verifier: 256 random bits, URL-safe (43 characters)."""
    return secrets.token_urlsafe(32)


_providers: dict[ProviderConfig, Provider] = {}
_providers_lock = threading.Lock()


def provider_for(config: ProviderConfig) -> Provider:
    """The process's Provider for `config`: its documents are read once per process and kept,
    and a changed configuration (tests change settings) gets a fresh one."""
    with _providers_lock:
        if config not in _providers:
            _providers.clear()
            _providers[config] = Provider(config)
        return _providers[config]


def forget_providers() -> None:
    with _providers_lock:
        _providers.clear()


# -- the ID token ----------------------------------------------------------------------------


def verify_id_token(
    token: Any, *, provider: Provider, nonce: str | None, now: float | None = None
) -> Claims:
    """The claims of an ID token that passes every check, with its nonce spent; Refused (400)
    naming the first check it failed otherwise.

    nonce=None only for a token given for a refresh token (signin.people.refresh_identity),
    which carries no nonce of a sign-in; a sign-in always passes the one it sent."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
        raise refused_token("the provider's answer holds no ID token", "id_token_missing")
    claims = signed_claims(token, provider=provider)
    check_claims(
        claims, config=provider.config, nonce=nonce, now=time.time() if now is None else now
    )
    if nonce is not None:
        spend_nonce(nonce)
    return Claims.from_token(claims, groups_claim=provider.config.groups_claim)


def signed_claims(token: Any, *, provider: Provider) -> dict[str, Any]:
    """The claims of a token signed by the provider (an ID token, or a back-channel logout
    token, signin.backchannel), its signature checked and nothing else; Refused (400) naming
    what is wrong."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
        raise refused_token("there is no token", "id_token_missing")
    try:
        signed = jws.extract_compact(token.encode("ascii"))
        header = signed.headers()
    except (JoseError, ValueError, TypeError, UnicodeError):
        raise refused_token("the ID token is not a signed token", "id_token_malformed") from None
    algorithm = header.get("alg")
    metadata = provider.metadata()
    allowed = metadata.algorithms
    if algorithm not in allowed:
        raise refused_token(
            f"the ID token is signed with {algorithm!r}, not one of {', '.join(allowed)} "
            "(the asymmetric algorithms the provider advertises)",
            "id_token_algorithm_refused",
        )
    kid = header.get("kid")
    key = provider.key_for(kid if isinstance(kid, str) else None, algorithm, metadata)
    try:
        valid = jws.validate_compact(signed, key, algorithms=[algorithm])
    except JoseError:
        valid = False
    if not valid:
        raise refused_token("the ID token's signature does not match", "id_token_bad_signature")
    try:
        claims = loads(signed.payload)
    except (ValueError, JSONRefused, RecursionError, UnicodeDecodeError):
        claims = None
    if not isinstance(claims, dict):
        raise refused_token("the ID token's claims are not a JSON object", "id_token_malformed")
    return claims


def check_claims(
    claims: dict[str, Any], *, config: ProviderConfig, nonce: str | None, now: float
) -> None:
    """OpenID Connect Core 3.1.3.7, the parts that apply to a confidential client."""
    if claims.get("iss") != config.issuer:
        raise refused_token(
            f"the ID token was issued by {claims.get('iss')!r}, not {config.issuer!r}",
            "id_token_wrong_issuer",
        )
    audience = claims.get("aud")
    audiences = [audience] if isinstance(audience, str) else audience
    if not isinstance(audiences, list) or config.client_id not in audiences:
        raise refused_token("the ID token is meant for another client", "id_token_wrong_audience")
    azp = claims.get("azp")
    if (azp is not None or len(audiences) > 1) and azp != config.client_id:
        raise refused_token(
            "the ID token was given to another client (azp)", "id_token_wrong_audience"
        )
    subject = claims.get("sub")
    if not isinstance(subject, str) or not subject or len(subject) > 255:
        raise refused_token("the ID token names no subject", "id_token_malformed")
    expires = claims.get("exp")
    if not _number(expires) or expires < now - LEEWAY_SECONDS:
        raise refused_token("the ID token has expired", "id_token_expired")
    issued = claims.get("iat")
    if not _number(issued) or issued > now + LEEWAY_SECONDS:
        raise refused_token("the ID token is issued in the future", "id_token_malformed")
    not_before = claims.get("nbf")
    if not_before is not None and (not _number(not_before) or not_before > now + LEEWAY_SECONDS):
        raise refused_token("the ID token is not valid yet", "id_token_malformed")
    given = claims.get("nonce")
    if nonce is None:
        return
    if not isinstance(given, str) or not secrets.compare_digest(given, nonce):
        raise refused_token(
            "the ID token's nonce is not the one this sign-in sent", "id_token_nonce_mismatch"
        )


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def spend_nonce(nonce: str) -> None:
    """Mark a nonce used; Refused when it already was (a token replayed)."""
    from .models import SpentNonce

    now = timezone.now()
    digest = hashlib.sha256(nonce.encode()).hexdigest()
    SpentNonce.objects.filter(until__lt=now).delete()
    try:
        with transaction.atomic():
            SpentNonce.objects.create(digest=digest, until=now + timedelta(days=SPENT_NONCE_DAYS))
    except IntegrityError:
        raise refused_token(
            "this ID token was already used for a sign-in", "id_token_replayed"
        ) from None
