"""An OpenID Connect provider for tests: panva's oidc-provider (OpenID Certified), run by
tests/support/oidc/provider.mjs on 127.0.0.1, as the company identity provider llmgw signs
people in with.

    def test_it_signs_in(oidc_provider: OidcProvider) -> None:
        oidc_provider.put_user("u-1", email="ada@example.com", groups=["ml"])
        client_id, secret = oidc_provider.add_client(redirect_uris=[f"{live}/oidc/callback"])
        ...  # the relying party sends the browser (or a requests.Session) to the provider
        callback = oidc_provider.sign_in(http, authorization_url, "u-1")  # or browser_sign_in

What it offers: discovery, JWKS (one RS256 key made at start), the authorization code flow
with PKCE and nonce, refresh tokens to every client registered for the refresh_token grant,
the device authorization grant (RFC 8628), RP-initiated and back-channel logout. Scopes:
openid, email (email, email_verified), profile (name, preferred_username), groups (groups, a
list of strings), offline_access; the scopes' claims are in the ID token itself.

The sign-in page (/interaction/UID) has `input[name=login]` (a user's preferred_username or
subject), `input[name=password]` (any value or none), one `button[type=submit]` and a cancel
link `a#cancel` (the relying party gets error=access_denied); an unknown or disabled user gets
the page again with `p[role=alert]` saying so. Consent is given at once, without a page.
The other pages are oidc-provider's, as it writes them (less the web font they load from
outside): the device verification page (/device) has
`input[name=user_code]` and `button:has-text("Continue")`, its confirmation page the same
button (and `button[name=abort]`), its last page `<h1>Sign-in Success</h1>`; the logout page
(end_session) has `button[name=logout][value=yes]` ("Yes, sign me out").

Refresh tokens: without offline_access one ends with the user's session at the provider
(logout, sign_out); with offline_access, which OIDC Core grants only with prompt=consent, it
outlives it.

Users and clients are added while it runs, through its control API (/__test__/..., behind a
random token): tests start their servers on ports known only then. A removed or disabled user's
tokens stop working: the refresh grant answers invalid_grant.

The package is installed by `scripts/system-deps oidc` (make test does) into a cache folder
per version, the version package.json pins. Without it the tests that need it skip, except
under CI=true, where they fail: there the install is part of the run.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

import pytest
import requests

from tests.support.ports import free_port
from tests.support.system import ROOT
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from playwright.sync_api import Page

__all__ = [
    "OidcControlRefused",
    "OidcProvider",
    "decode_jwt",
    "find_provider_install",
    "oidc_provider_fixture",
    "pkce_pair",
    "verify_jwt",
]

FOLDER = ROOT / "tests" / "support" / "oidc"
PACKAGE_JSON = FOLDER / "package.json"
SCRIPT = FOLDER / "provider.mjs"
# The grant types a client gets unless it names its own: all three the provider offers.
GRANT_TYPES = (
    "authorization_code",
    "refresh_token",
    "urn:ietf:params:oauth:grant-type:device_code",
)
# Starting takes under a second here, a few on a loaded machine (see start()).
START_TIMEOUT = 30
STOP_TIMEOUT = 10


def pinned_version() -> str:
    """The oidc-provider version package.json pins (scripts/system-deps reads the same line)."""
    return json.loads(PACKAGE_JSON.read_text())["dependencies"]["oidc-provider"]


def install_folder(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """Where scripts/system-deps installs the pinned version (the same rule as its own)."""
    cache = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME", "~")) / ".cache")
    return Path(cache).expanduser() / "llmgw" / f"oidc-provider-{pinned_version()}"


def find_provider_install(
    environ: dict[str, str] | os._Environ[str] = os.environ,
) -> Path | None:
    """The folder scripts/system-deps installed oidc-provider into; None when it is not
    installed, or there is no node to run it."""
    folder = install_folder(environ)
    if not (folder / ".installed").exists() or shutil.which("node") is None:
        return None
    return folder


def require_provider_install() -> Path:
    """The install folder, or the test skips (fails under CI=true) saying how to install it."""
    folder = find_provider_install()
    if folder is not None:
        return folder
    message = (
        f"oidc-provider {pinned_version()} is not installed in {install_folder()} (or node is "
        "missing): `scripts/system-deps oidc` installs it (make test does)"
    )
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{message}; under CI=true the install is part of the run", pytrace=False)
    pytest.skip(message)


# -- JWTs: RS256 in a few lines, so that tests need no JOSE library ------------------------------

# The DER prefix of a SHA-256 DigestInfo (RFC 8017, section 9.2, note 1).
_SHA256_DIGEST_INFO = bytes.fromhex("3031300d060960864801650304020105000420")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _number(text: str) -> int:
    return int.from_bytes(_b64decode(text), "big")


def _pkcs1_v15_sha256(message: bytes, size: int) -> int:
    """EMSA-PKCS1-v1_5 of message's SHA-256 digest, `size` bytes long, as a number."""
    digest_info = _SHA256_DIGEST_INFO + hashlib.sha256(message).digest()
    padded = b"\x00\x01" + b"\xff" * (size - len(digest_info) - 3) + b"\x00" + digest_info
    return int.from_bytes(padded, "big")


def sign_rs256(signing_input: bytes, private_jwk: dict[str, Any]) -> bytes:
    modulus = _number(private_jwk["n"])
    size = (modulus.bit_length() + 7) // 8
    encoded = _pkcs1_v15_sha256(signing_input, size)
    return pow(encoded, _number(private_jwk["d"]), modulus).to_bytes(size, "big")


def verify_rs256(signing_input: bytes, signature: bytes, public_jwk: dict[str, Any]) -> bool:
    modulus, exponent = _number(public_jwk["n"]), _number(public_jwk["e"])
    size = (modulus.bit_length() + 7) // 8
    if len(signature) != size:
        return False
    recovered = pow(int.from_bytes(signature, "big"), exponent, modulus)
    return recovered == _pkcs1_v15_sha256(signing_input, size)


def decode_jwt(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A JWT's header and claims, NOT verified."""
    header, claims, _signature = token.split(".")
    return json.loads(_b64decode(header)), json.loads(_b64decode(claims))


def verify_jwt(token: str, jwks: dict[str, Any]) -> dict[str, Any]:
    """The claims of an RS256 JWT whose signature one of the JWKS's keys (by kid) verifies;
    ValueError otherwise. Checks the signature only: iss, aud, exp, nonce are the caller's."""
    header, claims = decode_jwt(token)
    if header.get("alg") != "RS256":
        raise ValueError(f"the token is signed with {header.get('alg')!r}, not RS256")
    keys = [key for key in jwks["keys"] if key.get("kid") == header.get("kid")]
    if not keys:
        raise ValueError(f"no key in the JWKS has the token's kid {header.get('kid')!r}")
    signing_input, _, signature = token.rpartition(".")
    if not verify_rs256(signing_input.encode("ascii"), _b64decode(signature), keys[0]):
        raise ValueError("the token's signature does not verify")
    return claims


def pkce_pair() -> tuple[str, str]:
    """A PKCE code verifier and its S256 code challenge (RFC 7636)."""
    verifier = secrets.token_urlsafe(48)
    return verifier, _b64encode(hashlib.sha256(verifier.encode("ascii")).digest())


# -- the provider's pages, read as a browser would ----------------------------------------------


@dataclass
class _Form:
    id: str | None
    action: str
    fields: dict[str, str] = field(default_factory=dict)


class _Forms(HTMLParser):
    """The forms of a page: each one's id, action and the names and values of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[_Form] = []
        self._open: _Form | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {name: value or "" for name, value in attrs}
        if tag == "form":
            self._open = _Form(attributes.get("id"), attributes.get("action", ""))
            self.forms.append(self._open)
        elif tag == "input" and self._open is not None and attributes.get("name"):
            self._open.fields[attributes["name"]] = attributes.get("value", "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._open = None


def _forms(response: requests.Response) -> list[_Form]:
    parser = _Forms()
    parser.feed(response.text)
    return parser.forms


def _form(response: requests.Response, *, having: str) -> _Form:
    """The page's form with an input named `having`; AssertionError showing the page if none."""
    for form in _forms(response):
        if having in form.fields:
            return form
    raise AssertionError(
        f"{response.request.method} {response.url} answered {response.status_code} with no "
        f"form with {having!r}:\n{response.text[:3000]}"
    )


class OidcControlRefused(Exception):
    """The control API refused a request: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _process_state(pid: int) -> str:
    """What /proc says a process is doing: its state, the kernel function it waits in, its
    threads."""
    found = []
    for name in ("status", "wchan", "syscall"):
        try:
            text = Path(f"/proc/{pid}/{name}").read_text(errors="replace")
        except OSError as exc:
            text = f"({exc.strerror})"
        if name == "status":
            text = " ".join(
                line for line in text.splitlines() if line.startswith(("State", "Threads"))
            )
        found.append(f"{name}: {text.strip()}")
    return "; ".join(found)


class OidcProvider:
    """One provider process, on 127.0.0.1, in a process group of its own, stopped by its pid.

    Use it as a context manager (or start() and stop()); the `oidc_provider` fixture does."""

    def __init__(self, install: Path, *, log: Path | None = None) -> None:
        self.install = install
        self.log = log or Path(tempfile.mkdtemp(prefix="llmgw-oidc-")) / "provider.log"
        self.control_token = secrets.token_urlsafe(32)
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self._discovery: dict[str, Any] | None = None

    # -- the process --------------------------------------------------------------------------

    def start(self) -> None:
        # A port free when taken can be bound by another process before the provider binds it:
        # then it exits with EADDRINUSE, and another port is tried. A process that neither
        # listens nor exits within START_TIMEOUT is stopped, with what /proc says of it in the
        # log, and a new one started: in a run of the suite on CI's machine two starts in a row
        # on one worker printed the package's first warning and then nothing for 120 s, while
        # the next start there, and every other, was ready in under a second (cause not found).
        for _attempt in range(4):
            self.port = free_port()
            if self._started_on(self.port):
                return
        raise AssertionError(f"the OIDC provider did not start; its log:\n{self._log_text()}")

    def _started_on(self, port: int) -> bool:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                ["node", str(SCRIPT), "--port", str(port), "--install", str(self.install)],
                cwd=FOLDER,
                env={**os.environ, "OIDC_CONTROL_TOKEN": self.control_token, "NO_COLOR": "1"},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        process = self.process
        ready = f"READY {self.issuer}\n"
        try:
            wait_for(
                lambda: ready in self._log_text() or process.poll() is not None,
                timeout=START_TIMEOUT,
                what=f"the OIDC provider to print {ready.strip()!r} (its log: {self.log})",
            )
        except AssertionError:
            stuck = _process_state(process.pid)
            self.stop()
            with self.log.open("a") as log:
                log.write(f"[tests] no READY within {START_TIMEOUT} s; the process was: {stuck}\n")
            return False
        if process.poll() is None:
            return True
        self.process = None
        if "EADDRINUSE" in self._log_text():
            return False
        raise AssertionError(
            f"the OIDC provider exited with {process.returncode}; its log:\n{self._log_text()}"
        )

    def _log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM to its process group, then SIGKILL if it is still there after a while."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT)

    def __enter__(self) -> OidcProvider:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- what a relying party is configured with ----------------------------------------------

    @property
    def issuer(self) -> str:
        assert self.port is not None, "the provider is not started"
        return f"http://127.0.0.1:{self.port}"

    def discovery(self) -> dict[str, Any]:
        """/.well-known/openid-configuration (read once)."""
        if self._discovery is None:
            response = requests.get(f"{self.issuer}/.well-known/openid-configuration", timeout=10)
            response.raise_for_status()
            self._discovery = response.json()
        return self._discovery

    def jwks(self) -> dict[str, Any]:
        response = requests.get(self.discovery()["jwks_uri"], timeout=10)
        response.raise_for_status()
        return response.json()

    # -- the control API ----------------------------------------------------------------------

    def _control(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = requests.request(
            method,
            f"{self.issuer}/__test__/{path}",
            json=body,
            headers={"Authorization": f"Bearer {self.control_token}"},
            timeout=30,
        )
        if response.status_code >= 400:
            raise OidcControlRefused(response.status_code, response.json()["error"])
        return response.json() if response.content else None

    def put_user(
        self,
        sub: str,
        *,
        email: str | None = None,
        name: str | None = None,
        preferred_username: str | None = None,
        groups: Iterable[str] = (),
        disabled: bool = False,
    ) -> dict[str, Any]:
        """Adds or replaces a user; what is not given is made from the subject (SUB@example.com,
        a name and preferred_username of SUB). Answers the user as the provider now has it."""
        given = {"email": email, "name": name, "preferred_username": preferred_username}
        body = {
            **{key: value for key, value in given.items() if value is not None},
            "groups": list(groups),
            "disabled": disabled,
        }
        return self._control("PUT", f"users/{sub}", body)

    def remove_user(self, sub: str) -> None:
        self._control("DELETE", f"users/{sub}")

    def add_client(
        self,
        *,
        redirect_uris: Iterable[str],
        client_id: str | None = None,
        client_secret: str | None = None,
        post_logout_redirect_uris: Iterable[str] = (),
        backchannel_logout_uri: str | None = None,
        backchannel_logout_session_required: bool = True,
        grant_types: Iterable[str] = GRANT_TYPES,
        token_endpoint_auth_method: str = "client_secret_basic",
        **metadata: Any,
    ) -> tuple[str, str]:
        """Registers (or replaces) a confidential client; answers its (client_id, secret), made
        at random where not given. More client metadata (RFC 7591 names) goes in `metadata`.
        With a back-channel logout URI the ID tokens carry `sid`, and so do the logout tokens,
        unless backchannel_logout_session_required is False. The secrets made here are
        URL-safe; with client_secret_basic, a given one with other characters must be
        form-encoded before Basic encoding (RFC 6749, 2.3.1), as oidc-provider checks."""
        client_id = client_id or f"client-{secrets.token_hex(6)}"
        client_secret = client_secret or secrets.token_urlsafe(32)
        grant_types = list(grant_types)
        body: dict[str, Any] = {
            "client_secret": client_secret,
            "redirect_uris": list(redirect_uris),
            "post_logout_redirect_uris": list(post_logout_redirect_uris),
            "grant_types": grant_types,
            # "code" goes with the authorization_code grant; a device-only client has none.
            "response_types": ["code"] if "authorization_code" in grant_types else [],
            "token_endpoint_auth_method": token_endpoint_auth_method,
            **metadata,
        }
        if backchannel_logout_uri is not None:
            body["backchannel_logout_uri"] = backchannel_logout_uri
            body["backchannel_logout_session_required"] = backchannel_logout_session_required
        self._control("PUT", f"clients/{client_id}", body)
        return client_id, client_secret

    def remove_client(self, client_id: str) -> None:
        self._control("DELETE", f"clients/{client_id}")

    def signing_jwk(self) -> dict[str, Any]:
        """The provider's private signing key (a JWK with kid, alg RS256, use sig)."""
        return self._control("GET", "signing-key")

    def mint_jwt(self, claims: dict[str, Any], *, header: dict[str, Any] | None = None) -> str:
        """A JWT with `claims`, signed with the provider's own key: a valid signature on claims
        the provider would never issue (a wrong iss, aud or nonce, an exp in the past)."""
        key = self.signing_jwk()
        header = {"alg": "RS256", "typ": "JWT", "kid": key["kid"], **(header or {})}
        signing_input = ".".join(
            _b64encode(json.dumps(part, separators=(",", ":")).encode())
            for part in (header, claims)
        )
        signature = sign_rs256(signing_input.encode("ascii"), key)
        return f"{signing_input}.{_b64encode(signature)}"

    def sign_out(self, sub: str) -> list[dict[str, Any]]:
        """Ends the user's sessions at the provider, as "sign me out everywhere" does: a logout
        token POSTed to the back-channel logout URI of each client the user signed in to (before
        this returns), their grants revoked unless given offline_access, the sessions gone.
        Answers one {client_id, sid, delivered, error} per logout token sent."""
        return self._control("POST", "sign-out", {"sub": sub})["deliveries"]

    # -- a user at the provider's pages -------------------------------------------------------

    def _on_provider(self, url: str) -> bool:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc}" == self.issuer

    def _follow(self, http: requests.Session, response: requests.Response) -> requests.Response:
        """Follows the redirects that stay on the provider; answers the first response that is
        not one: a page of the provider, or the redirect to the relying party."""
        while response.is_redirect and self._on_provider(
            target := urljoin(response.url, response.headers["location"])
        ):
            response = http.get(target, allow_redirects=False, timeout=30)
        return response

    def sign_in(self, http: requests.Session, authorization_url: str, username: str) -> str:
        """Signs `username` (preferred_username or sub) in through the provider's pages, with
        `http` as the browser (it keeps the provider's cookies: a second sign-in in it needs no
        form), starting at the authorization request `authorization_url`. Answers where the
        provider then sends the browser: the relying party's redirect_uri with code and state,
        or with error (the query response mode, the code flow's default). AssertionError with
        the page if it stops on a page of its own (an unknown or disabled user's, form_post's)."""
        response = self._follow(
            http, http.get(authorization_url, allow_redirects=False, timeout=30)
        )
        if not response.is_redirect:
            form = _form(response, having="login")
            response = http.post(
                urljoin(response.url, form.action),
                data={**form.fields, "login": username, "password": "any"},
                allow_redirects=False,
                timeout=30,
            )
            response = self._follow(http, response)
        if not response.is_redirect:
            raise AssertionError(
                f"the sign-in of {username!r} stopped at {response.url} "
                f"({response.status_code}):\n{response.text[:3000]}"
            )
        return urljoin(response.url, response.headers["location"])

    def browser_sign_in(self, page: Page, username: str) -> None:
        """On the provider's sign-in page in Playwright's `page`: types `username`, submits, and
        returns once the page the provider then sends the browser to has loaded."""
        page.locator("input[name=login]").fill(username)
        with page.expect_navigation():
            page.locator("button[type=submit]").click()

    def approve_device(
        self, user_code: str, username: str, *, http: requests.Session | None = None
    ) -> None:
        """Does what the user does on the device verification page (/device): enters the user
        code, confirms, signs in as `username`. The device's next token request then gets its
        tokens. AssertionError with the page if the provider does not answer "Sign-in Success"."""
        http = http or requests.Session()
        page = http.get(f"{self.issuer}/device", timeout=30)
        form = _form(page, having="user_code")
        page = http.post(
            urljoin(page.url, form.action), data={**form.fields, "user_code": user_code}, timeout=30
        )
        form = _form(page, having="confirm")  # "The following code should be displayed ..."
        page = self._follow(
            http,
            http.post(
                urljoin(page.url, form.action), data=form.fields, allow_redirects=False, timeout=30
            ),
        )
        if any("login" in form.fields for form in _forms(page)):
            form = _form(page, having="login")
            page = self._follow(
                http,
                http.post(
                    urljoin(page.url, form.action),
                    data={**form.fields, "login": username, "password": "any"},
                    allow_redirects=False,
                    timeout=30,
                ),
            )
        if page.status_code != 200 or "Sign-in Success" not in page.text:
            raise AssertionError(
                f"approving device code {user_code} as {username!r} stopped at {page.url} "
                f"({page.status_code}):\n{page.text[:3000]}"
            )

    def end_session(self, http: requests.Session, **params: str) -> requests.Response:
        """RP-initiated logout in `http` (the browser that signed in): the end_session request
        with `params` (id_token_hint, post_logout_redirect_uri, state, client_id), then "Yes,
        sign me out" on the provider's page. The back-channel logout tokens are sent before the
        answer, the provider's redirect (303) to post_logout_redirect_uri or its own page."""
        page = http.get(self.discovery()["end_session_endpoint"], params=params, timeout=30)
        form = _form(page, having="xsrf")
        return http.post(
            urljoin(page.url, form.action),
            data={**form.fields, "logout": "yes"},
            allow_redirects=False,
            timeout=30,
        )


# Named apart from the fixture so that the tests' `oidc_provider` arguments do not redefine an
# imported name (ruff's F811).
@pytest.fixture(scope="session", name="oidc_provider")
def oidc_provider_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    """`oidc_provider`: a running provider for the whole test session (each test makes its own
    users and clients, with names of its own). Skips, or fails under CI=true, without the
    install. A conftest.py (or a test module) makes it available by importing it:

        from tests.support.oidc_provider import oidc_provider_fixture  # noqa: F401
    """
    install = require_provider_install()
    log = tmp_path_factory.mktemp("oidc-provider") / "provider.log"
    with OidcProvider(install, log=log) as provider:
        yield provider
