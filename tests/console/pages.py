"""Reading the console's answers in tests: their text, and one row of the models list."""

from __future__ import annotations

import re
from typing import Any

HTMX = {"HX-Request": "true", "HX-Current-URL": "http://testserver/models/tiny-chat/"}


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
