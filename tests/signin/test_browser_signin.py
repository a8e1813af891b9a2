"""Sign in with your company, end to end: headless Chromium, the Django live server and a real
OpenID Connect provider (tests/support/oidc_provider.py, panva's oidc-provider)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from catalog.models import AuditEntry
from signin.models import Identity
from signin.oidc import forget_providers
from tests.console.conftest import IN_A_BROWSER, SCREENSHOTS, chromium  # noqa: F401
from tests.support.oidc_provider import OidcProvider, oidc_provider_fixture  # noqa: F401

pytestmark = [*IN_A_BROWSER, pytest.mark.django_db(transaction=True)]

roles = pytest.importorskip(
    "access.roles", reason="access.roles (the group mapping) is not here yet"
)


@pytest.fixture
def site(live_server: Any, oidc_provider: OidcProvider, settings: Any, tmp_path: Path) -> Any:
    """llmgw on the live server, signing people in through the provider."""
    client_id, secret = oidc_provider.add_client(
        redirect_uris=[f"{live_server.url}/signin/callback"]
    )
    secret_file = tmp_path / "client-secret"
    handle = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(handle, "w") as out:
        out.write(secret)
    settings.LLMGW_PUBLIC_URL = live_server.url
    settings.LLMGW_OIDC_ISSUER = oidc_provider.issuer
    settings.LLMGW_OIDC_CLIENT_ID = client_id
    settings.LLMGW_OIDC_CLIENT_SECRET_FILE = str(secret_file)
    settings.LLMGW_OIDC_PROVIDER_NAME = "Example Corp"
    settings.LLMGW_OIDC_GROUP_MAP = "ml=member:research, ml-leads=admin"
    settings.LLMGW_LOCAL_PASSWORDS = False
    forget_providers()
    yield live_server
    forget_providers()


def sign_in(browser: Any, url: str, provider: OidcProvider, username: str) -> Any:
    # A context of its own: no session at llmgw or at the provider from an earlier sign-in.
    page = browser.new_context().new_page()
    page.set_default_timeout(15_000)
    page.goto(f"{url}/keys/")
    assert "/login/" in page.url
    assert page.locator("#username").is_hidden()  # passwords off: the form is folded away
    with page.expect_navigation():
        page.click("text=Sign in with Example Corp")
    assert page.url.startswith(provider.issuer)
    provider.browser_sign_in(page, username)
    page.wait_for_url(f"{url}/keys/")
    return page


def test_a_person_is_made_at_the_first_sign_in_and_kept_up_to_date(
    chromium: Any,  # noqa: F811
    site: Any,
    oidc_provider: OidcProvider,
) -> None:
    oidc_provider.put_user(
        "ada-sub",
        email="ada@example.com",
        name="Ada Lovelace",
        preferred_username="ada",
        groups=["ml"],
    )
    page = sign_in(chromium, site.url, oidc_provider, "ada")
    assert "Log out ada" in page.content()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "signin-keys-after-sign-in.png"), full_page=True)

    user = get_user_model().objects.get(username="ada")
    assert (user.email, user.first_name, user.last_name) == ("ada@example.com", "Ada", "Lovelace")
    identity = Identity.objects.get(user=user)
    assert (identity.issuer, identity.subject, identity.groups) == (
        oidc_provider.issuer,
        "ada-sub",
        ["ml"],
    )
    assert list(user.llmgw_teams.values_list("name", flat=True)) == ["research"]
    assert not user.is_staff

    # At the provider, Ada changes address and becomes a lead: the next sign-in says so.
    oidc_provider.put_user(
        "ada-sub",
        email="ada@lovelace.example",
        name="Ada King",
        preferred_username="ada-k",
        groups=["ml-leads"],
    )
    sign_in(chromium, site.url, oidc_provider, "ada-k")
    user.refresh_from_db()
    assert (user.username, user.email, user.last_name) == ("ada", "ada@lovelace.example", "King")
    assert Identity.objects.get(user=user).groups == ["ml-leads"]
    assert user.is_staff
    assert not user.llmgw_teams.exists()
    entries = AuditEntry.objects.filter(model_name="user ada", action="sign-in").order_by("id")
    assert [e.note for e in entries] == [
        "first sign-in: the account was made (provider)",
        "signed in (provider)",
    ]
    assert entries[1].changes["groups"] == [["ml"], ["ml-leads"]]
