"""tests/support/oidc_provider.py: the OpenID Connect provider the sign-in tests run, driven over
real HTTP as a relying party drives it: discovery, the code flow with PKCE, the device flow,
refresh tokens that stop working when the user goes, and both kinds of logout."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest
import requests

from tests.support.oidc_provider import (
    OidcControlRefused,
    OidcProvider,
    decode_jwt,
    find_provider_install,
    install_folder,
    oidc_provider_fixture,  # noqa: F401  (the fixture `oidc_provider`)
    pinned_version,
    pkce_pair,
    verify_jwt,
)
from tests.support.ports import free_port
from tests.support.system import ROOT
from tests.support.waiting import wait_for

# Nothing listens on the discard port: the relying party's side is never followed here.
REDIRECT_URI = "http://127.0.0.1:9/oidc/callback"
SCOPE = "openid email profile groups"
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
# Debian's Chromium, as the console's browser tests use it (no browser download).
CHROMIUM = "/usr/bin/chromium"
SYSTEM_DEPS = ROOT / "scripts" / "system-deps"


def new_user(provider: OidcProvider, **fields: Any) -> str:
    sub = f"user-{secrets.token_hex(4)}"
    provider.put_user(sub, **fields)
    return sub


def authorization_request(
    provider: OidcProvider,
    client_id: str,
    *,
    scope: str = SCOPE,
    redirect_uri: str = REDIRECT_URI,
) -> tuple[str, dict[str, str]]:
    """An authorization URL with PKCE (S256), state and nonce; and what the relying party keeps."""
    verifier, challenge = pkce_pair()
    kept = {
        "verifier": verifier,
        "state": secrets.token_urlsafe(),
        "nonce": secrets.token_urlsafe(),
    }
    query = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": redirect_uri,
        "scope": scope,
        "state": kept["state"],
        "nonce": kept["nonce"],
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    return f"{provider.discovery()['authorization_endpoint']}?{urlencode(query)}", kept


def callback_parameters(callback: str, redirect_uri: str = REDIRECT_URI) -> dict[str, str]:
    assert callback.startswith(f"{redirect_uri}?"), callback
    return {name: values[0] for name, values in parse_qs(urlsplit(callback).query).items()}


def token_request(
    provider: OidcProvider, client: tuple[str, str], **form: str
) -> requests.Response:
    return requests.post(provider.discovery()["token_endpoint"], data=form, auth=client, timeout=30)


def signed_in(
    provider: OidcProvider,
    client: tuple[str, str],
    sub: str,
    *,
    http: requests.Session | None = None,
    scope: str = SCOPE,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The token response of a whole code flow for `sub`, and what the relying party kept."""
    url, kept = authorization_request(provider, client[0], scope=scope)
    answer = callback_parameters(provider.sign_in(http or requests.Session(), url, sub))
    assert answer["state"] == kept["state"], answer
    response = token_request(
        provider,
        client,
        grant_type="authorization_code",
        code=answer["code"],
        redirect_uri=REDIRECT_URI,
        code_verifier=kept["verifier"],
    )
    assert response.status_code == 200, response.text
    return response.json(), kept


class RelyingParty:
    """The two endpoints of a relying party the provider sends to, on 127.0.0.1: the redirect
    URI, which keeps the URLs a browser arrives with, and the back-channel logout URI, which
    keeps the logout tokens."""

    def __init__(self) -> None:
        self.callbacks: list[str] = []
        self.logout_tokens: list[str] = []
        relying_party = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if not self.path.startswith("/oidc/callback?"):
                    self.answer(b"", status=404)  # a browser also asks for /favicon.ico
                    return
                relying_party.callbacks.append(f"{relying_party.origin}{self.path}")
                self.answer(b"<!DOCTYPE html><title>Signed in</title><h1>Signed in</h1>")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"])).decode()
                relying_party.logout_tokens.extend(parse_qs(body)["logout_token"])
                self.answer(b"")

            def answer(self, body: bytes, status: int = 200) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_port}"
        self.redirect_uri = f"{self.origin}/oidc/callback"
        self.backchannel_logout_uri = f"{self.origin}/oidc/backchannel-logout"

    def __enter__(self) -> RelyingParty:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def relying_party() -> Iterator[RelyingParty]:
    with RelyingParty() as started:
        yield started


# -- the install: scripts/system-deps oidc, here with a stand-in npm --------------------------------

FAKE_NPM = """#!/bin/sh
# npm install, run in a folder holding package.json: an oidc-provider of the pinned version
# that loads (an empty ES module).
echo "$@" >> "$NPM_CALLS"
[ -n "${NPM_FAILS:-}" ] && { echo "npm error code E404"; exit 1; }
version=$(sed -n 's/.*"oidc-provider": "\\(.*\\)".*/\\1/p' package.json)
mkdir -p node_modules/oidc-provider
printf '{"name": "oidc-provider", "version": "%s", "type": "module", "main": "index.js"}' \\
  "$version" > node_modules/oidc-provider/package.json
echo 'export default class Provider {}' > node_modules/oidc-provider/index.js
"""


def install_with_fake_npm(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "npm").write_text(FAKE_NPM)
    (bin_dir / "npm").chmod(0o755)
    environ = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "NPM_CALLS": str(tmp_path / "npm-calls"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        **env,
    }
    result = subprocess.run(
        [str(SYSTEM_DEPS), "oidc"], env=environ, cwd="/", capture_output=True, text=True, timeout=60
    )
    return result, environ


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_system_deps_installs_it_once_where_the_fixture_finds_it(tmp_path: Path) -> None:
    assert pinned_version().startswith("9.")  # the major version the provider script is for
    folder = tmp_path / "cache" / "llmgw" / f"oidc-provider-{pinned_version()}"

    first, environ = install_with_fake_npm(tmp_path)

    assert (first.returncode, first.stderr) == (0, "")
    assert first.stdout.splitlines() == [
        f"installing oidc-provider@{pinned_version()} into {folder}"
    ]
    assert install_folder(environ) == folder
    assert find_provider_install(environ) == folder
    assert [path.name for path in folder.parent.iterdir()] == [folder.name]  # no partial left
    again, _environ = install_with_fake_npm(tmp_path)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    assert len((tmp_path / "npm-calls").read_text().splitlines()) == 1


def test_a_failed_install_says_so_leaves_nothing_and_succeeds(tmp_path: Path) -> None:
    result, environ = install_with_fake_npm(tmp_path, NPM_FAILS="1")

    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:] == [
        f"note: npm could not install oidc-provider@{pinned_version()}; its last lines:",
        "  npm error code E404",
        "run this again once the registry can be reached; until then the sign-in tests that "
        "need it skip (and fail under CI=true).",
    ]
    assert not any((tmp_path / "cache" / "llmgw").iterdir())
    assert find_provider_install(environ) is None


# -- the provider -------------------------------------------------------------------------------


def test_it_answers_discovery_with_the_endpoints_a_relying_party_uses(
    oidc_provider: OidcProvider,
) -> None:
    issuer = oidc_provider.issuer
    discovery = oidc_provider.discovery()
    assert discovery["issuer"] == issuer
    assert {
        name: discovery[name]
        for name in (
            "authorization_endpoint",
            "token_endpoint",
            "userinfo_endpoint",
            "jwks_uri",
            "device_authorization_endpoint",
            "end_session_endpoint",
        )
    } == {
        "authorization_endpoint": f"{issuer}/auth",
        "token_endpoint": f"{issuer}/token",
        "userinfo_endpoint": f"{issuer}/me",
        "jwks_uri": f"{issuer}/jwks",
        "device_authorization_endpoint": f"{issuer}/device/auth",
        "end_session_endpoint": f"{issuer}/session/end",
    }
    assert {"openid", "email", "profile", "groups", "offline_access"} <= set(
        discovery["scopes_supported"]
    )
    assert discovery["code_challenge_methods_supported"] == ["S256"]
    assert discovery["backchannel_logout_supported"] is True
    assert discovery["backchannel_logout_session_supported"] is True
    (key,) = oidc_provider.jwks()["keys"]
    assert (key["kty"], key["alg"], key["use"]) == ("RSA", "RS256", "sig")
    assert "d" not in key


def test_it_signs_in_with_code_and_pkce_to_an_id_token_with_the_users_claims(
    oidc_provider: OidcProvider,
) -> None:
    sub = new_user(
        oidc_provider,
        email="ada@example.com",
        name="Ada Lovelace",
        preferred_username="ada",
        groups=["ml-team", "llmgw-admins"],
    )
    client = oidc_provider.add_client(redirect_uris=[REDIRECT_URI])

    tokens, kept = signed_in(oidc_provider, client, "ada")  # by preferred_username

    claims = verify_jwt(tokens["id_token"], oidc_provider.jwks())
    assert claims["iss"] == oidc_provider.issuer
    assert claims["aud"] == client[0]
    assert claims["nonce"] == kept["nonce"]
    assert claims["exp"] > time.time()
    assert {
        name: claims[name]
        for name in ("sub", "email", "email_verified", "name", "preferred_username", "groups")
    } == {
        "sub": sub,
        "email": "ada@example.com",
        "email_verified": True,
        "name": "Ada Lovelace",
        "preferred_username": "ada",
        "groups": ["ml-team", "llmgw-admins"],
    }
    userinfo = requests.get(
        oidc_provider.discovery()["userinfo_endpoint"],
        headers={"Authorization": f"Bearer {tokens['access_token']}"},
        timeout=30,
    ).json()
    assert (userinfo["sub"], userinfo["groups"]) == (sub, ["ml-team", "llmgw-admins"])


def test_a_code_is_refused_without_its_pkce_verifier(oidc_provider: OidcProvider) -> None:
    sub = new_user(oidc_provider)
    client = oidc_provider.add_client(redirect_uris=[REDIRECT_URI])
    url, _kept = authorization_request(oidc_provider, client[0])
    answer = callback_parameters(oidc_provider.sign_in(requests.Session(), url, sub))

    response = token_request(
        oidc_provider,
        client,
        grant_type="authorization_code",
        code=answer["code"],
        redirect_uri=REDIRECT_URI,
        code_verifier=pkce_pair()[0],
    )

    assert response.status_code == 400
    assert response.json()["error"] == "invalid_grant"


def test_a_browser_signed_in_once_is_not_asked_again(oidc_provider: OidcProvider) -> None:
    sub = new_user(oidc_provider)
    client = oidc_provider.add_client(redirect_uris=[REDIRECT_URI])
    http = requests.Session()
    signed_in(oidc_provider, client, sub, http=http)

    url, _kept = authorization_request(oidc_provider, client[0])
    first = http.get(url, allow_redirects=False, timeout=30)

    assert first.status_code in (302, 303)
    assert "code" in callback_parameters(first.headers["location"])


@pytest.mark.browser
@pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"{CHROMIUM} is missing: `apt-get install -y chromium` (Debian's package)",
)
def test_a_browser_signs_in_on_the_sign_in_page(
    oidc_provider: OidcProvider, relying_party: RelyingParty
) -> None:
    from playwright.sync_api import sync_playwright

    username = f"grace-{secrets.token_hex(3)}"
    new_user(oidc_provider, preferred_username=username)
    client = oidc_provider.add_client(redirect_uris=[relying_party.redirect_uri])
    url, kept = authorization_request(
        oidc_provider, client[0], redirect_uri=relying_party.redirect_uri
    )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page()
            page.goto(url)
            assert page.locator("h1").inner_text() == f"Sign in to {client[0]}"

            oidc_provider.browser_sign_in(page, username)

            assert page.locator("h1").inner_text() == "Signed in"
            landed = page.url
        finally:
            browser.close()
    assert relying_party.callbacks == [landed]
    answer = callback_parameters(landed, relying_party.redirect_uri)
    assert answer["state"] == kept["state"]
    assert "code" in answer


def test_the_sign_in_page_refuses_unknown_and_disabled_users(oidc_provider: OidcProvider) -> None:
    disabled = new_user(oidc_provider, disabled=True)
    client = oidc_provider.add_client(redirect_uris=[REDIRECT_URI])
    url, _kept = authorization_request(oidc_provider, client[0])

    for login, problem in [
        ("nobody-here", 'No user is called "nobody-here".'),
        (disabled, f'The user "{disabled}" is disabled.'),
    ]:
        with pytest.raises(AssertionError) as stopped:
            oidc_provider.sign_in(requests.Session(), url, login)
        assert f'<p role="alert">{problem.replace(chr(34), "&quot;")}</p>' in str(stopped.value)


def test_its_pages_load_nothing_from_outside_the_machine(oidc_provider: OidcProvider) -> None:
    sub = new_user(oidc_provider)
    client = oidc_provider.add_client(redirect_uris=[REDIRECT_URI])
    http = requests.Session()
    tokens, _kept = signed_in(oidc_provider, client, sub, http=http)
    pages = {
        "sign-in": requests.get(authorization_request(oidc_provider, client[0])[0], timeout=30),
        "device": requests.get(f"{oidc_provider.issuer}/device", timeout=30),
        "logout": http.get(
            oidc_provider.discovery()["end_session_endpoint"],
            params={"id_token_hint": tokens["id_token"]},
            timeout=30,
        ),
        "error": requests.get(oidc_provider.discovery()["authorization_endpoint"], timeout=30),
    }

    assert {name: response.status_code for name, response in pages.items()} == {
        "sign-in": 200,
        "device": 200,
        "logout": 200,
        "error": 400,
    }
    assert 'value="yes" name="logout">Yes, sign me out</button>' in pages["logout"].text
    for name, response in pages.items():
        assert "://" not in response.text.replace(oidc_provider.issuer, ""), (name, response.text)


def test_cancelling_the_sign_in_sends_access_denied(oidc_provider: OidcProvider) -> None:
    client = oidc_provider.add_client(redirect_uris=[REDIRECT_URI])
    url, kept = authorization_request(oidc_provider, client[0])
    http = requests.Session()
    page = http.get(url, timeout=30)
    assert page.url.startswith(f"{oidc_provider.issuer}/interaction/")

    cancelled = http.get(f"{page.url}/abort", timeout=30, allow_redirects=False)
    while urlsplit(cancelled.headers["location"]).netloc == urlsplit(oidc_provider.issuer).netloc:
        cancelled = http.get(cancelled.headers["location"], timeout=30, allow_redirects=False)

    answer = callback_parameters(cancelled.headers["location"])
    assert (answer["error"], answer["state"]) == ("access_denied", kept["state"])


def test_a_device_approved_through_the_verification_page_gets_tokens(
    oidc_provider: OidcProvider,
) -> None:
    sub = new_user(oidc_provider, groups=["ml-team"])
    client = oidc_provider.add_client(redirect_uris=[], grant_types=[DEVICE_GRANT, "refresh_token"])
    started = requests.post(
        oidc_provider.discovery()["device_authorization_endpoint"],
        data={"scope": SCOPE},
        auth=client,
        timeout=30,
    ).json()
    assert started["verification_uri"] == f"{oidc_provider.issuer}/device"
    form = {"grant_type": DEVICE_GRANT, "device_code": started["device_code"]}
    pending = token_request(oidc_provider, client, **form)
    assert pending.json()["error"] == "authorization_pending"

    oidc_provider.approve_device(started["user_code"], sub)

    tokens = token_request(oidc_provider, client, **form).json()
    claims = verify_jwt(tokens["id_token"], oidc_provider.jwks())
    assert (claims["sub"], claims["aud"], claims["groups"]) == (sub, client[0], ["ml-team"])
    assert "refresh_token" in tokens


def test_the_refresh_grant_works_until_the_user_is_removed(oidc_provider: OidcProvider) -> None:
    sub = new_user(oidc_provider, groups=["before"])
    client = oidc_provider.add_client(redirect_uris=[REDIRECT_URI])
    tokens, _kept = signed_in(oidc_provider, client, sub, scope=f"{SCOPE} offline_access")
    oidc_provider.put_user(sub, groups=["after"])

    refreshed = token_request(
        oidc_provider, client, grant_type="refresh_token", refresh_token=tokens["refresh_token"]
    )
    assert refreshed.status_code == 200, refreshed.text
    assert verify_jwt(refreshed.json()["id_token"], oidc_provider.jwks())["groups"] == ["after"]

    oidc_provider.remove_user(sub)
    refused = token_request(
        oidc_provider,
        client,
        grant_type="refresh_token",
        refresh_token=refreshed.json().get("refresh_token", tokens["refresh_token"]),
    )
    assert (refused.status_code, refused.json()["error"]) == (400, "invalid_grant")


def test_the_refresh_grant_fails_once_the_user_is_disabled(oidc_provider: OidcProvider) -> None:
    sub = new_user(oidc_provider)
    client = oidc_provider.add_client(redirect_uris=[REDIRECT_URI])
    tokens, _kept = signed_in(oidc_provider, client, sub)

    oidc_provider.put_user(sub, disabled=True)

    refused = token_request(
        oidc_provider, client, grant_type="refresh_token", refresh_token=tokens["refresh_token"]
    )
    assert (refused.status_code, refused.json()["error"]) == (400, "invalid_grant")


def assert_logout_token(provider: OidcProvider, token: str, client_id: str, sub: str) -> str:
    """Checks a logout token as OIDC Back-Channel Logout 1.0 asks; answers its sid."""
    header, _claims = decode_jwt(token)
    claims = verify_jwt(token, provider.jwks())
    assert header["typ"] == "logout+jwt"
    assert (claims["iss"], claims["aud"], claims["sub"]) == (provider.issuer, client_id, sub)
    assert claims["events"] == {"http://schemas.openid.net/event/backchannel-logout": {}}
    assert "nonce" not in claims
    return claims["sid"]


def test_signing_out_at_the_provider_sends_back_channel_logout_and_ends_the_tokens(
    oidc_provider: OidcProvider, relying_party: RelyingParty
) -> None:
    sub = new_user(oidc_provider)
    client = oidc_provider.add_client(
        redirect_uris=[REDIRECT_URI], backchannel_logout_uri=relying_party.backchannel_logout_uri
    )
    tokens, _kept = signed_in(oidc_provider, client, sub)
    sid = verify_jwt(tokens["id_token"], oidc_provider.jwks())["sid"]

    deliveries = oidc_provider.sign_out(sub)

    assert deliveries == [{"client_id": client[0], "sid": sid, "delivered": True, "error": None}]
    (token,) = relying_party.logout_tokens
    assert assert_logout_token(oidc_provider, token, client[0], sub) == sid
    # Without offline_access the refresh token ends with the session.
    refused = token_request(
        oidc_provider, client, grant_type="refresh_token", refresh_token=tokens["refresh_token"]
    )
    assert (refused.status_code, refused.json()["error"]) == (400, "invalid_grant")
    assert oidc_provider.sign_out(sub) == []


def test_rp_initiated_logout_sends_back_channel_logout_and_returns_to_the_client(
    oidc_provider: OidcProvider, relying_party: RelyingParty
) -> None:
    sub = new_user(oidc_provider)
    after_logout = "http://127.0.0.1:9/signed-out"
    client = oidc_provider.add_client(
        redirect_uris=[REDIRECT_URI],
        post_logout_redirect_uris=[after_logout],
        backchannel_logout_uri=relying_party.backchannel_logout_uri,
    )
    http = requests.Session()
    tokens, _kept = signed_in(oidc_provider, client, sub, http=http)

    ended = oidc_provider.end_session(
        http,
        id_token_hint=tokens["id_token"],
        post_logout_redirect_uri=after_logout,
        state="back-to-llmgw",
    )

    assert (ended.status_code, ended.headers["location"]) == (
        303,
        f"{after_logout}?state=back-to-llmgw",
    )
    (token,) = wait_for(lambda: relying_party.logout_tokens, what="the logout token")
    sid = verify_jwt(tokens["id_token"], oidc_provider.jwks())["sid"]
    assert assert_logout_token(oidc_provider, token, client[0], sub) == sid


def test_a_minted_token_carries_a_valid_signature_on_any_claims(
    oidc_provider: OidcProvider,
) -> None:
    forged = {"iss": "https://elsewhere.example", "aud": "someone", "sub": "x", "exp": 1}

    token = oidc_provider.mint_jwt(forged)

    assert verify_jwt(token, oidc_provider.jwks()) == forged
    key = oidc_provider.signing_jwk()
    assert key["kid"] == oidc_provider.jwks()["keys"][0]["kid"]
    assert {"d", "p", "q"} <= key.keys()
    # Another token's claims under this token's signature.
    other = oidc_provider.mint_jwt({**forged, "sub": "y"})
    tampered = f"{other.rpartition('.')[0]}.{token.rpartition('.')[2]}"
    with pytest.raises(ValueError, match="does not verify"):
        verify_jwt(tampered, oidc_provider.jwks())


def test_the_control_api_answers_only_with_its_token(oidc_provider: OidcProvider) -> None:
    response = requests.get(f"{oidc_provider.issuer}/__test__/signing-key", timeout=30)
    assert (response.status_code, response.json()) == (
        401,
        {"error": "The control API needs the control token."},
    )
    with pytest.raises(OidcControlRefused) as refused:
        oidc_provider.add_client(redirect_uris=["not a url"])
    assert refused.value.status == 400
    assert refused.value.message.startswith("The client is refused: ")
    with pytest.raises(OidcControlRefused) as refused:
        oidc_provider.remove_user("nobody-here")
    assert (refused.value.status, refused.value.message) == (
        404,
        'No user has the subject "nobody-here".',
    )
