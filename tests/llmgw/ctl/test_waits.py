"""Every wait of `llmgw ctl` is bounded, and says what it waited for when it gives up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from catalog.models import Model
from llmgw.cli import main
from llmgw.client import CtlError
from llmgw.ctl import updates
from llmgw.tinygguf import write_tiny_model
from registry.models import Fetch
from tests.support.registry import LocalRegistry, available

REPO = "acme/tiny-chat"


@pytest.fixture
def registry(tmp_path: Path, server_yaml: Any) -> Iterator[LocalRegistry]:
    reason = available()
    if reason:
        pytest.skip(reason)
    write_tiny_model(tmp_path / "tiny.gguf", seed=1)
    with LocalRegistry(tmp_path / "registry") as running:
        running.commit(REPO, {"tiny-chat-q4.gguf": tmp_path / "tiny.gguf"})
        server_yaml(
            {"registry": {"endpoint": running.endpoint}, "mirror": {"root": str(tmp_path / "m")}}
        )
        yield running


@pytest.mark.django_db(transaction=True)
def test_serve_gives_up_on_a_fetch_no_worker_starts(
    registry: LocalRegistry,
    live_server: Any,
    tokens: dict[str, str],
    capsys: Any,
    monkeypatch: Any,
) -> None:
    # No worker runs in this test (tasks are not queued), so the fetch stays queued.
    monkeypatch.setenv("LLMGW_URL", live_server.url)
    monkeypatch.setenv("LLMGW_TOKEN", tokens["alice"])
    code = main(["ctl", "model", "serve", REPO, "--timeout", "1.5"])
    _, err = capsys.readouterr()
    fetch = Fetch.objects.get()
    assert code == 1
    assert err.splitlines()[-1] == (
        f"error: gave up after 1.5s waiting for fetch {fetch.pk} of {REPO} to start: no worker has "
        "picked it up. Is the worker running (celery -A llmgw_site worker)? It stays on the "
        f"server: follow it at {live_server.url}/fetches/{fetch.pk}/"
    )
    assert fetch.state == Fetch.QUEUED
    assert not Model.objects.exists()


class _Server:
    """Answers the same thing to every poll: the one piece under test is the waiting."""

    url = "http://127.0.0.1:8000"

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer
        self.polls = 0

    def get(self, path: str, **_: Any) -> dict[str, Any]:
        self.polls += 1
        return self.answer


def test_a_fetch_that_stops_moving_is_given_up_on() -> None:
    fetch = {"id": 7, "repo": REPO, "state": "running", "bytes_done": 5_000_000}
    fetch |= {"bytes_total": 9_000_000, "message": "fetching tiny.gguf"}
    server = _Server(fetch)
    with pytest.raises(CtlError) as gave_up:
        updates._follow_fetch(server, fetch, limit=1)  # type: ignore[arg-type]
    assert str(gave_up.value) == (
        f"gave up after 1s without progress on fetch 7 of {REPO} (5.0 of 9.0 MB, fetching "
        "tiny.gguf). It stays on the server: follow it at http://127.0.0.1:8000/fetches/7/"
    )
    assert server.polls >= 2


def test_a_rollout_that_stops_moving_is_given_up_on(capsys: Any) -> None:
    rollout = {"kind": "update", "state": "rolling", "step": "waiting for a new replica"}
    with pytest.raises(CtlError) as gave_up:
        updates._follow_rollout(_Server(rollout), "tiny-chat", rollout, limit=1)  # type: ignore[arg-type]
    assert str(gave_up.value) == (
        "gave up after 1s with the update of tiny-chat still at 'rolling: waiting for a new "
        "replica'; it goes on on the server: llmgw ctl model target tiny-chat"
    )
