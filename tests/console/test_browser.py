"""The console in a real browser: headless Chromium (Debian's) driven by Playwright.

Screenshots go to test-output/screenshots/, at a laptop's width and a phone's.
"""

from __future__ import annotations

from typing import Any

import pytest

from catalog.models import Model
from fleet.models import Node
from fleet.reconciler import reconcile_pass
from tests.console.conftest import IN_A_BROWSER, SCREENSHOTS

LAPTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}

pytestmark = [*IN_A_BROWSER, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def site(live_server: Any, fleet: Any) -> Any:
    """alice's tiny-chat with one ready replica on node-a."""
    fleet.node("node-a")
    fleet.add(
        "tiny-chat",
        adapters=[{"name": "tiny-sql", "source": "http://127.0.0.1:8000/mirror/a/b/c/sql.gguf"}],
    )
    fleet.add(
        "big-chat", min_replicas=0, max_replicas=2, profiles=[{"name": "cpu", "memory_gb": 4}]
    )
    reconcile_pass()
    fleet.beat("node-a")
    return live_server


def log_in(browser: Any, url: str, username: str, viewport: dict[str, int] = LAPTOP) -> Any:
    page = browser.new_page(viewport=viewport)
    page.set_default_timeout(10_000)
    page.goto(f"{url}/")
    assert "/login/" in page.url
    page.fill("#username", username)
    page.fill("#password", f"{username}-password-1")
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/")
    return page


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def test_log_in_and_see_the_models(chromium: Any, site: Any) -> None:
    page = log_in(chromium, site.url, "alice")
    row = page.locator("tr#model-tiny-chat")
    assert row.locator("td").nth(1).inner_text() == "alice"
    assert "1/1" in row.inner_text() and "node-a" in row.inner_text()
    assert "on demand" in page.locator("tr#model-big-chat").inner_text()
    shot(page, "models-1280")

    # Filtering swaps the table in place, and the address follows.
    page.select_option("select[name=state]", "not-running")
    page.wait_for_url("**state=not-running**")
    page.locator("tr#model-tiny-chat").wait_for(state="detached")
    assert page.locator("tr[data-model]").count() == 1


def test_scale_with_htmx_without_a_reload(chromium: Any, site: Any) -> None:
    page = log_in(chromium, site.url, "alice")
    page.click("text=tiny-chat")
    page.wait_for_url("**/models/tiny-chat/")
    # A marker on window survives only if the page is not reloaded.
    page.evaluate("window.__still_here = 'yes'")
    page.fill("#scale-min", "2")
    page.click("#scale-form button[type=submit]")
    page.locator("#scale-form .notice.success").wait_for()
    assert page.locator("#scale-form .notice.success").inner_text() == (
        "Scale in force: 2 replicas (max 2, follows min)."
    )
    assert page.evaluate("window.__still_here") == "yes"
    # The summary and the history were refreshed out of band.
    assert "of 2 wanted" in page.locator("#model-summary").inner_text()
    assert "scale" in page.locator("#model-history").inner_text()
    assert Model.objects.get(name="tiny-chat").min_replicas == 2

    # A refusal is swapped in the same way, its problem beside the field.
    page.fill("#scale-min", "3")
    page.fill("#scale-max", "1")
    page.click("#scale-form button[type=submit]")
    page.locator("#scale-form .notice.error").wait_for()
    assert "The scale was refused" in page.locator("#scale-form .notice.error").inner_text()
    assert "max (1) is below min (3)" in page.locator("#scale-form .field.has-errors").inner_text()
    assert page.evaluate("window.__still_here") == "yes"
    shot(page, "model-1280")


def test_add_a_model_and_see_the_problem_at_its_line(chromium: Any, site: Any) -> None:
    page = log_in(chromium, site.url, "alice")
    page.click("text=Add a model")
    page.wait_for_url("**/add/")
    page.fill(
        "#add-definition",
        "name: pasted\n"
        "source: http://127.0.0.1:8000/mirror/a/b/c/pasted.gguf\n"
        "min_replicas: -1\n"
        "profiles:\n"
        "  - {name: cpu, memory_gb: 1}\n",
    )
    page.check("#add-skip_source_check")
    page.click("#add-form button[type=submit]")
    problem = page.locator("#line-3 .problem")
    problem.wait_for()
    assert problem.inner_text() == "min_replicas: must not be negative"
    line = page.locator("#line-3 code").bounding_box()
    box = problem.bounding_box()
    assert line and box and 0 <= box["y"] - (line["y"] + line["height"]) < 30  # right under it
    assert page.locator(".yaml-lines .problem").count() == 1
    shot(page, "add-problem-1280")

    # Fixed, it is added and the browser goes to its page.
    page.fill("#add-definition", page.input_value("#add-definition").replace("-1", "0"))
    page.check("#add-skip_source_check")
    page.click("#add-form button[type=submit]")
    page.wait_for_url("**/models/pasted/")
    assert "pasted was added, owned by alice" in page.locator("#flash").inner_text()


def test_staff_cordon_a_node(chromium: Any, site: Any) -> None:
    page = log_in(chromium, site.url, "staff")
    page.click("nav >> text=Nodes")
    page.wait_for_url("**/nodes/")
    card = page.locator("article#node-node-a")
    assert "1 / 8 GB reserved · 7 free" in card.inner_text()
    page.evaluate("window.__still_here = 'yes'")
    card.locator("button", has_text="Cordon").click()
    card.locator("button", has_text="Uncordon").wait_for()
    assert "cordoned" in card.locator(".chip").first.inner_text()
    assert page.evaluate("window.__still_here") == "yes"
    assert Node.objects.get(name="node-a").cordoned
    shot(page, "nodes-1280")


def test_pages_at_a_phone_width(chromium: Any, site: Any) -> None:
    page = log_in(chromium, site.url, "alice", viewport=PHONE)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"the models page is {width}px wide on a phone"
    shot(page, "models-390")
    page.goto(f"{site.url}/models/tiny-chat/")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    shot(page, "model-390")
    page.goto(f"{site.url}/nodes/")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    shot(page, "nodes-390")
    page.goto(f"{site.url}/audit/")
    shot(page, "audit-390")
    # Screenshots of the wider pages too, for a look at both sizes.
    page.set_viewport_size(LAPTOP)
    page.goto(f"{site.url}/audit/")
    shot(page, "audit-1280")
