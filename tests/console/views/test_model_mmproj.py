"""The console shows a model's vision projector, and its Serve form passes one on."""

from __future__ import annotations

from typing import Any

import pytest

from console.forms import ServeForm
from tests.console.pages import text_of

pytestmark = [pytest.mark.django_db]


def test_the_model_page_shows_the_projector(client_for: Any, fleet: Any) -> None:
    fleet.add("vision", mmproj="vision/mmproj-f16.gguf")
    fleet.add("text")
    vision = text_of(client_for("alice").get("/models/vision/"))
    assert "Vision projector vision/mmproj-f16.gguf (at the weights' revision)" in vision
    assert "Vision projector" not in text_of(client_for("alice").get("/models/text/"))


def test_the_serve_form_passes_a_projector_on_and_leaves_an_empty_one_out() -> None:
    form = ServeForm(data={"repo": "acme/vision", "mmproj": "mmproj.gguf"})
    assert form.is_valid(), form.errors
    assert form.cleaned_data["serve"]["mmproj"] == "mmproj.gguf"
    empty = ServeForm(data={"repo": "acme/vision", "mmproj": ""})
    assert empty.is_valid(), empty.errors
    assert empty.cleaned_data["serve"]["mmproj"] == ""
    bad = ServeForm(data={"repo": "acme/vision", "mmproj": "../x.gguf"})
    assert not bad.is_valid()
    assert "is not a projector file" in bad.errors["mmproj"][0]
