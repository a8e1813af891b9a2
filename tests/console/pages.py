"""Reading the console's answers in tests: their text, and one row of the models list."""

from __future__ import annotations

import re
from typing import Any

HTMX = {"HX-Request": "true", "HX-Current-URL": "http://testserver/models/tiny-chat/"}
# The limits forms as the Teams and Keys pages send them for a team or key without limits: every
# field, unchanged.
TEAM_LIMITS_UNCHANGED = {
    "rpm": "",
    "tpm": "",
    "max_parallel": "",
    "tokens_per_day": "",
    "tokens_per_month": "",
    "models": "",
    "weight": "1",
}
KEY_LIMITS_UNCHANGED = {**TEAM_LIMITS_UNCHANGED, "team": "", "expires": ""}


def text_of(response: Any) -> str:
    """The response's text with tags and runs of whitespace collapsed, for asserting sentences."""
    html = response.content.decode()
    return (
        re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))
        .replace("&#x27;", "'")
        .replace("&quot;", '"')
        .replace("&#x60;", "`")
    )


def row_of(html: str, name: str) -> str:
    """The models list's row for one model."""
    start = html.index(f'<tr id="model-{name}"')
    return html[start : html.index("</tr>", start)]
