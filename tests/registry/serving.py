"""Serving the test repository as a person would, through the services and the fetch."""

from __future__ import annotations

from typing import Any

from catalog.models import Model
from core.actor import Actor
from registry import fetches
from registry.models import Fetch
from registry.updates import serve_start

REPO = "acme/tiny-chat-GGUF"


def serve(alice: Actor, **options: Any) -> Model:
    fetch = serve_start(actor=alice, repo=REPO, **options)
    fetches.run_fetch(fetch.pk)
    fetch.refresh_from_db()
    assert fetch.state == Fetch.DONE, fetch.message
    return Model.objects.get(name=fetch.serve_definition["name"])
