"""The audit page: changes newest first, filtered and a page at a time."""

from __future__ import annotations

from typing import Any

import pytest

from tests.console.pages import text_of

pytestmark = [pytest.mark.django_db]


def test_the_audit_page_lists_changes_newest_first(client_for: Any, running: Any) -> None:
    client_for("alice").post("/models/tiny-chat/scale", {"min": 2})
    response = client_for("carol").get("/audit/")
    text = text_of(response)
    assert text.index("alice via console") < text.index("alice via API")
    assert "min_replicas : 1 → 2" in text


def test_the_audit_page_filters_and_pages(client_for: Any, running: Any) -> None:
    client = client_for("alice")
    for count in range(2, 55):
        client.post("/models/tiny-chat/scale", {"min": count % 3 + 1})
    html = client.get("/audit/?model=tiny-chat&action=scale").content.decode()
    assert html.count("<tr>") == 1 + 50  # the header row and one page
    assert "Page 1 of 2" in text_of(client.get("/audit/?model=tiny-chat&action=scale"))
    assert 'href="/audit/?model=tiny-chat&amp;action=scale&amp;page=2"' in html
    only_bob = client.get("/audit/?actor=bob").content.decode()
    assert "other-chat" in only_bob and "tiny-chat</a>" not in only_bob
    partial = client.get("/audit/?action=add", headers={"HX-Request": "true"}).content.decode()
    assert partial.lstrip().startswith('<div id="audit-table">')
