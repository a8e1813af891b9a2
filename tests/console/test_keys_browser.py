"""The Keys page in a real browser (headless Chromium, Debian's, driven by Playwright): a key made
and shown once, its limits set and revoked, each without a reload."""

from __future__ import annotations

from typing import Any

import pytest

from access.models import GatewayKey
from tests.console.conftest import IN_A_BROWSER, SCREENSHOTS

pytestmark = [*IN_A_BROWSER, pytest.mark.django_db(transaction=True)]


def test_make_limit_and_revoke_a_key_without_a_reload(
    chromium: Any, live_server: Any, users: dict[str, Any]
) -> None:
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(10_000)
    page.goto(f"{live_server.url}/keys/")
    page.fill("#username", "alice")
    page.fill("#password", "alice-password-1")
    page.click("button[type=submit]")
    page.wait_for_url("**/keys/")
    assert "No gateway keys yet" in page.inner_text("main")
    page.evaluate("window.__still_here = 'yes'")

    page.click("text=New key")
    page.fill("#new-key-name", "billing bot")
    page.fill("#new-key-tokens_per_day", "50000")
    page.click("#key-create-form button[type=submit]")
    secret = page.locator("#new-key-secret").inner_text()
    key = GatewayKey.objects.get()
    assert secret.startswith(key.prefix) and key.tokens_per_day == 50000
    card = page.locator(f"article#key-{key.pk}")
    assert "0 of 50,000 (0%)" in card.inner_text()

    card.locator("summary", has_text="Set limits").click()
    card.locator(f"#key-{key.pk}-rpm").fill("120")
    card.locator("button", has_text="Set limits").click()
    page.locator(f"article#key-{key.pk} .notice.success").wait_for()
    card = page.locator(f"article#key-{key.pk}")
    assert "Requests per minute: 120" in card.inner_text()
    key.refresh_from_db()
    assert key.rpm == 120
    page.screenshot(path=str(SCREENSHOTS / "keys-1280.png"), full_page=True)

    page.on("dialog", lambda dialog: dialog.accept())
    card.locator("button", has_text="Revoke").click()
    page.locator(f"article#key-{key.pk} .chip.key-revoked").wait_for()
    assert page.evaluate("window.__still_here") == "yes"
    key.refresh_from_db()
    assert key.revoked_at is not None
