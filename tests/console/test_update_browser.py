"""Registry updates in a real browser, against the whole product running as real processes.

olah serves a git-lfs repository; `System` runs gunicorn, a Celery worker with beat and a node
agent that starts real llama.cpp replicas. In headless Chromium the admin serves the model from
the Add model page, sees the update badge once new weights are pushed and checked, updates, and
rolls back, watching each reach done without a page reload. Screenshots go to
test-output/screenshots/update-*.png.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.tinygguf import write_tiny_model
from tests.console.conftest import SCREENSHOTS, whole_product_in_a_browser
from tests.support.registry import LocalRegistry
from tests.support.system import System, wait_for

LAPTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
REPO = "acme/tiny-chat-GGUF"
MODEL = "tiny-chat-q4"

pytestmark = whole_product_in_a_browser()


@pytest.fixture
def product(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """olah with the first weights, and llmgw with one node (room for two replicas)."""
    for seed in (1, 2):
        write_tiny_model(tmp_path / f"weights-{seed}.gguf", seed=seed)
    registry = LocalRegistry(tmp_path / "registry")
    first = registry.commit(REPO, {f"{MODEL}.gguf": tmp_path / "weights-1.gguf"})
    system: System | None = None
    try:
        registry.start()
        system = System(tmp_path / "system", config={"registry": {"endpoint": registry.endpoint}})
        system.start()
        system.add_node("node-a", memory_gb=3, cores=2)
        wait_for(
            lambda: [n["state"] for n in system.api("GET", "nodes")] == ["ready"],  # type: ignore[union-attr]
            what="the node agent",
        )
        yield {"system": system, "registry": registry, "folder": tmp_path, "first": first}
    except BaseException:
        if system is not None:
            print(system.log_tail())
        raise
    finally:
        if system is not None:
            system.close()
        registry.stop()


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"update-{name}.png"), full_page=True)


def ready_replicas(system: System) -> list[dict[str, Any]]:
    replicas = system.api("GET", f"models/{MODEL}/target")["replicas"]
    return [r for r in replicas if r["routable"]]


def watch(page: Any, badge: Any, kind: str, name: str, timeout: float = 60) -> list[str]:
    """The states a rollout's badge shows until it is done; a screenshot of the first rolling one."""
    seen: list[str] = []

    def finished() -> bool:
        text = badge.inner_text() if badge.count() else ""
        if text and (not seen or seen[-1] != text):
            seen.append(text)
            if text == f"{kind}: rolling":
                shot(page, f"{name}-rolling-1280")
        return text in (f"{kind}: done", f"{kind}: failed", f"{kind}: halted")

    try:
        wait_for(finished, timeout=timeout, interval=0.2, what=f"the {kind} to finish")
    except AssertionError as unfinished:
        raise AssertionError(f"{unfinished}; the badge showed {seen}") from None
    return seen


def test_serve_update_and_roll_back_in_the_browser(product: dict[str, Any], chromium: Any) -> None:
    system, registry, folder = product["system"], product["registry"], product["folder"]
    old = product["first"][:7]
    page = chromium.new_page(viewport=LAPTOP)
    page.set_default_timeout(15_000)

    # Log in as the admin the product created.
    page.goto(f"{system.url}/")
    assert "/login/" in page.url
    page.fill("#username", "admin")
    page.fill("#password", system.admin_password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{system.url}/")

    # Serve the repository from the Add model page, following the fetch until the model is in.
    page.click("text=Add a model")
    page.wait_for_url("**/add/")
    page.fill("#serve-repo", REPO)
    page.fill("#serve-memory_gb", "1")
    page.click("#serve-form button[type=submit]")
    added = page.locator("section.fetch .notice.success")
    added.wait_for(timeout=30_000)
    assert f"{MODEL} was added" in added.inner_text()
    assert "/fetches/" in page.url  # the fetch's own page, should it be reloaded
    assert page.locator("section.fetch progress").get_attribute("value") == "100"
    shot(page, "served-1280")
    page.click(f"text=Open {MODEL}")
    page.wait_for_url(f"**/models/{MODEL}/")
    wait_for(lambda: ready_replicas(system), timeout=60, what="a ready replica")

    # New weights in the registry, and the check that notices them.
    new = registry.commit(REPO, {f"{MODEL}.gguf": folder / "weights-2.gguf"}, message="retrained")[
        :7
    ]
    system.api("POST", "updates/check")

    page.goto(f"{system.url}/")
    row = page.locator(f"tr#model-{MODEL}")
    assert f"update available: {old} → {new}, 1 file, 501 kB" in row.inner_text()
    shot(page, "badge-1280")

    # Update from the list; the progress refreshes itself in place.
    page.evaluate("window.__still_here = 'yes'")
    row.locator("summary", has_text="Update…").click()
    row.locator("button", has_text=f"Yes, update to {new}").click()
    seen = watch(page, row.locator(".rollout .badge"), "update", "update")
    assert seen[-1] == "update: done", seen
    assert page.evaluate("window.__still_here") == "yes", "the page was reloaded"
    assert "update available" not in row.inner_text()
    # The whole row followed: its source is the new commit's file now.
    assert f"/{new}" in row.locator("td.source code").get_attribute("title")
    shot(page, "update-done-1280")
    assert len(ready_replicas(system)) >= 1

    # Roll back from the same row, the same way.
    row.locator("summary", has_text="Roll back…").click()
    row.locator("button", has_text=f"Yes, roll back to {old}").click()
    seen = watch(page, row.locator(".rollout .badge"), "rollback", "rollback")
    assert seen[-1] == "rollback: done", seen
    assert page.evaluate("window.__still_here") == "yes", "the page was reloaded"
    assert f"/{product['first']}/" in row.locator("td.source code").get_attribute("title")
    shot(page, "rollback-done-1280")

    # The model page: back on the first commit, the update's files kept as the previous revision.
    page.goto(f"{system.url}/models/{MODEL}/")
    registry_part = page.locator("#model-registry")
    text = registry_part.inner_text()
    assert f"{REPO}, branch main, commit {old}" in text
    assert f"What Roll back returns to: commit {new}, kept in the mirror." in text
    assert "rollback: done" in text
    page.evaluate("window.__still_here = 'yes'")
    registry_part.locator("button", has_text="Check for updates now").click()
    checked = registry_part.locator(".notice.success")
    checked.wait_for()
    assert f"Checked: update available: {old} → {new}, 1 file, 501 kB." in checked.inner_text()
    assert page.evaluate("window.__still_here") == "yes"
    shot(page, "model-1280")
    registry_part.screenshot(path=str(SCREENSHOTS / "update-model-registry-1280.png"))

    # The same pages at a phone's width.
    page.set_viewport_size(PHONE)
    page.reload()
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    shot(page, "model-390")
    registry_part.screenshot(path=str(SCREENSHOTS / "update-model-registry-390.png"))
    page.goto(f"{system.url}/")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    shot(page, "models-390")
    page.goto(f"{system.url}/add/")
    shot(page, "add-390")
