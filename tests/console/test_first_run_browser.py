"""The first run in a browser: from `llmgw_run` on a fresh folder to a published demo update,
Update and Roll back on the console, then traffic through the gateway and its chart.

Everything is real: the run command's processes (demo registry, gateway, web, worker with beat,
node agent with its engine), the official openai client, headless Chromium. Screenshots go to
test-output/screenshots/first-run-*.png.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from llmgw import demo
from llmgw.cli import main
from tests.console.conftest import SCREENSHOTS, whole_product_in_a_browser
from tests.console.test_update_browser import LAPTOP, watch
from tests.support.first_run import ADMIN_PASSWORD, FirstRun
from tests.support.system import wait_for

pytestmark = whole_product_in_a_browser()

MODEL = demo.DEMO_MODEL


@pytest.fixture
def first_run(tmp_path: Path) -> Iterator[FirstRun]:
    run = FirstRun(tmp_path)
    try:
        run.start()
        yield run
    except BaseException:
        print(run.log()[-6000:])
        raise
    finally:
        run.stop()


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"first-run-{name}.png"), full_page=True)


def test_a_newcomer_updates_rolls_back_and_sees_the_traffic(
    first_run: FirstRun, chromium: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    hub = demo.hub(first_run.folder / "demo-registry")
    first = hub.head(demo.DEMO_REPO)
    wait_for(lambda: first_run.model()["ready"] >= 1, timeout=180, what="the demo model ready")
    page = chromium.new_page(viewport=LAPTOP)
    page.set_default_timeout(15_000)
    page.goto(f"{first_run.url}/")
    page.fill("#username", "admin")
    page.fill("#password", ADMIN_PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{first_run.url}/")
    row = page.locator(f"tr#model-{MODEL}")
    assert "1/1" in row.inner_text()

    # New weights in the demo registry, and the check from the model page.
    assert main(["demo", "publish", "--folder", str(hub.folder)]) == 0
    second = hub.head(demo.DEMO_REPO)
    capsys.readouterr()
    page.goto(f"{first_run.url}/models/{MODEL}/")
    registry_part = page.locator("#model-registry")
    registry_part.locator("button", has_text="Check for updates now").click()
    checked = registry_part.locator(".notice.success")
    checked.wait_for()
    assert f"update available: {first[:7]} → {second[:7]}" in checked.inner_text()
    shot(page, "badge")

    # Update, then roll back, from the models list; each reaches done without a reload.
    page.goto(f"{first_run.url}/")
    row.locator("summary", has_text="Update…").click()
    row.locator("button", has_text=f"Yes, update to {second[:7]}").click()
    assert watch(page, row.locator(".rollout .badge"), "update", "first-run-update")[-1] == (
        "update: done"
    )
    row.locator("summary", has_text="Roll back…").click()
    row.locator("button", has_text=f"Yes, roll back to {first[:7]}").click()
    assert watch(page, row.locator(".rollout .badge"), "rollback", "first-run-rollback")[-1] == (
        "rollback: done"
    )
    wait_for(lambda: first_run.model()["ready"] >= 1, timeout=60, what="a ready replica again")

    # Traffic through the gateway with the official client and a key of the admin's.
    key = first_run.api("POST", "keys", json={"name": "first run"})["key"]
    client = OpenAI(base_url=f"{first_run.url}/v1", api_key=key, max_retries=0)
    completion_tokens = 0
    sent = 6
    for index in range(sent):
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"hello {index}"}],
            max_tokens=8,
        )
        assert answer.usage is not None
        completion_tokens += answer.usage.completion_tokens

    # The figures are written every few seconds; the model page shows them once they are.
    def traffic_table() -> list[tuple[int, int]] | None:
        page.goto(f"{first_run.url}/models/{MODEL}/")
        html = page.content()
        rows = re.findall(
            r'<td class="requests">(\d+)</td>.*?<td class="completion">(\d+)</td>', html, re.S
        )
        counted = [(int(r), int(c)) for r, c in rows]
        return counted if sum(r for r, _ in counted) >= sent else None

    rows = wait_for(traffic_table, timeout=30, interval=1, what="the traffic figures")
    assert sum(r for r, _ in rows) == sent
    assert sum(c for _, c in rows) == completion_tokens
    chart = page.locator('svg.chart[data-chart="Requests per 1 min"]')
    points = chart.locator('g[data-series="requests"] g.point')
    assert points.count() == len(rows) >= 1
    assert (
        sum(float(points.nth(i).get_attribute("data-value")) for i in range(points.count())) == sent
    )
    page.locator("#model-traffic details summary").click()
    shot(page, "traffic")

    # The models list has the last hour as a sparkline.
    page.goto(f"{first_run.url}/")
    spark = row.locator("svg.sparkline")
    assert f"{MODEL}: requests per minute: {sent} in the last hour" in spark.get_attribute(
        "aria-label"
    )
    shot(page, "models")
