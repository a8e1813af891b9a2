"""Back-channel logout from a real provider (oidc-provider): the provider ends a person's
session and tells llmgw, whose sessions of theirs end; forged or replayed logout tokens change
nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from catalog.models import AuditEntry
from signin.backchannel import LOGOUT_EVENT
from tests.signin.real_provider import use_provider
from tests.support.oidc_provider import OidcProvider, oidc_provider_fixture  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def world(
    oidc_provider: OidcProvider, live_server: Any, settings: Any, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    from signin.oidc import forget_providers

    client_id = use_provider(
        oidc_provider,
        settings,
        tmp_path,
        redirect_uris=[f"{live_server.url}/signin/callback"],
        backchannel_logout_uri=f"{live_server.url}/signin/backchannel-logout",
    )
    settings.LLMGW_PUBLIC_URL = live_server.url
    person = f"grace-{uuid.uuid4().hex[:6]}"
    oidc_provider.put_user(person, preferred_username=person, groups=["ml"])
    yield {"url": live_server.url, "person": person, "client_id": client_id}
    forget_providers()


def signed_in_browser(oidc_provider: OidcProvider, world: dict[str, Any]) -> requests.Session:
    http = requests.Session()
    start = http.get(f"{world['url']}/signin/start", allow_redirects=False, timeout=30)
    assert start.status_code == 302, start.text
    callback = oidc_provider.sign_in(http, start.headers["Location"], world["person"])
    landed = http.get(callback, timeout=30)
    assert landed.status_code == 200 and world["person"] in landed.text
    return http


def test_the_providers_logout_ends_the_persons_sessions(
    oidc_provider: OidcProvider, world: dict[str, Any]
) -> None:
    laptop = signed_in_browser(oidc_provider, world)
    phone = signed_in_browser(oidc_provider, world)
    sent = oidc_provider.sign_out(world["person"])
    assert sent and all(s["delivered"] for s in sent), sent
    for browser in (laptop, phone):
        page = browser.get(f"{world['url']}/", allow_redirects=False, timeout=30)
        assert page.status_code == 302 and "/login/" in page.headers["Location"]
    entry = AuditEntry.objects.filter(
        model_name=f"user {world['person']}", action="sign-out", actor_name="provider"
    ).first()
    assert entry is not None and "back-channel logout" in entry.note


def test_forged_and_replayed_logout_tokens_change_nothing(
    oidc_provider: OidcProvider, world: dict[str, Any]
) -> None:
    browser = signed_in_browser(oidc_provider, world)
    now = int(time.time())
    good = {
        "iss": oidc_provider.issuer,
        "aud": world["client_id"],
        "iat": now,
        "jti": uuid.uuid4().hex,
        "sub": "someone-else",
        "events": {LOGOUT_EVENT: {}},
    }
    forged = {
        "another audience": {**good, "aud": "another-client"},
        "another issuer": {**good, "iss": "http://127.0.0.1:9/"},
        "a nonce": {**good, "nonce": "n"},
        "no logout event": {**good, "events": {}},
        "issued an hour ago": {**good, "iat": now - 3600},
        "no subject": {k: v for k, v in good.items() if k != "sub"},
    }
    endpoint = f"{world['url']}/signin/backchannel-logout"
    for why, claims in forged.items():
        answer = requests.post(
            endpoint,
            data={
                "logout_token": oidc_provider.mint_jwt(
                    {**claims, "sub": world["person"]} if "sub" in claims else claims
                )
            },
            timeout=30,
        )
        assert answer.status_code == 400, why
        assert answer.json()["error"] == "invalid_request", why
    # Signed with a key of someone else's: refused.
    unsigned = oidc_provider.mint_jwt({**good, "sub": world["person"]}, header={"alg": "none"})
    answer = requests.post(endpoint, data={"logout_token": unsigned}, timeout=30)
    assert answer.status_code == 400
    assert browser.get(f"{world['url']}/", allow_redirects=False, timeout=30).status_code == 200
    # A real one for someone llmgw does not know: 200, and nothing happens; sent again: refused.
    token = oidc_provider.mint_jwt(good)
    assert requests.post(endpoint, data={"logout_token": token}, timeout=30).status_code == 200
    replayed = requests.post(endpoint, data={"logout_token": token}, timeout=30)
    assert replayed.status_code == 400 and "already used" in replayed.json()["error_description"]
    assert browser.get(f"{world['url']}/", allow_redirects=False, timeout=30).status_code == 200


def test_a_body_larger_than_a_logout_token_is_refused_unread(world: dict[str, Any]) -> None:
    endpoint = f"{world['url']}/signin/backchannel-logout"
    answer = requests.post(endpoint, data={"logout_token": "x" * (80 * 1024)}, timeout=30)
    assert answer.status_code == 400 and "larger than a logout token" in answer.text
