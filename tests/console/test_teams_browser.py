"""The Teams page in a real browser (headless Chromium, Debian's, driven by Playwright): staff add
a team, set its rpm and add a member, each without a reload; the member then sees the team and
its limit, with nothing to change."""

from __future__ import annotations

from typing import Any

import pytest

from access.models import Team
from catalog.models import AuditEntry
from tests.console.conftest import IN_A_BROWSER, SCREENSHOTS

pytestmark = [*IN_A_BROWSER, pytest.mark.django_db(transaction=True)]


def log_in(browser: Any, url: str, user: str) -> Any:
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.set_default_timeout(10_000)
    page.goto(f"{url}/teams/")
    page.fill("#username", user)
    page.fill("#password", f"{user}-password-1")
    page.click("button[type=submit]")
    page.wait_for_url("**/teams/")
    return page


def test_staff_add_a_team_set_its_rpm_and_a_member_who_then_sees_it(
    chromium: Any, live_server: Any, users: dict[str, Any]
) -> None:
    page = log_in(chromium, live_server.url, "staff")
    assert "No teams yet" in page.inner_text("main")
    page.evaluate("window.__still_here = 'yes'")

    page.click("text=New team")
    page.fill("#new-team-name", "research")
    page.click("#team-create-form button[type=submit]")
    page.locator("#teams-body .notice.success", has_text="Team research added.").wait_for()
    card = page.locator("article#team-research")
    assert "0 members" in card.inner_text()

    card.locator("summary", has_text="Set limits").click()
    card.locator("#team-research-rpm").fill("120")
    card.locator("button", has_text="Set limits").click()
    page.locator("article#team-research .notice.success").wait_for()
    card = page.locator("article#team-research")
    assert "Requests in the last minute" in card.inner_text()
    assert "0 of 120 (0%)" in card.inner_text()
    assert Team.objects.get().rpm == 120

    card.locator("summary", has_text="Members").click()
    card.locator("#team-research-members-add").fill("alice")
    card.locator("button", has_text="Change members").click()
    page.locator(
        "article#team-research .notice.success", has_text="Team research has 1 member(s): alice."
    ).wait_for()
    assert page.evaluate("window.__still_here") == "yes"
    page.screenshot(path=str(SCREENSHOTS / "teams-1280.png"), full_page=True)
    assert [(e.action, e.actor_name, e.door) for e in AuditEntry.objects.order_by("id")] == [
        ("team-add", "staff", "console"),
        ("team-limits", "staff", "console"),
        ("team-members", "staff", "console"),
    ]

    member = log_in(chromium, live_server.url, "alice")
    card = member.locator("article#team-research")
    text = card.inner_text()
    assert "members: alice" in text and "Requests per minute: 120" in text
    assert card.locator("form").count() == 0  # read-only for a member
    assert "research" not in log_in(chromium, live_server.url, "bob").inner_text("main")
