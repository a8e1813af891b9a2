"""A rollback from newer weights keeps them as the update available (issue 44, item 8): in
`llmgw ctl model updates` and its --json, the API it reads, and the console's badge, without
waiting for the next check (the check asks the registry again only when the branch moves)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from catalog.models import Model
from catalog.services import model_scale
from core.actor import Actor
from registry import fetches
from registry.models import Rollout
from registry.rollouts import advance_rollouts, start_rollback, start_update
from registry.updates import check_updates
from tests.registry.serving import REPO, serve
from tests.support.ctl import Ctl, ctl_as
from tests.support.registry import LocalRegistry, available

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


def updated(alice: Actor, registry: LocalRegistry, new_weights: Path) -> tuple[Model, str, str]:
    """The test repository served, then updated to `new_weights`: (model, old, new commit)."""
    model = serve(alice)
    old = model.origin["commit"]
    model_scale(
        actor=alice, name=model.name, min_replicas=0, max_replicas=0
    )  # no replicas to wait for
    new = registry.commit(REPO, {"tiny-chat-q4.gguf": new_weights})
    check_updates()
    rollout = start_update(actor=alice, name=model.name)
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    model.refresh_from_db()
    assert model.origin["commit"] == new and model.update_available is None
    return model, old, new


def test_it_keeps_the_revision_rolled_back_from_in_ctl_the_api_and_the_badge(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path], ctl: Ctl, users: Any
) -> None:
    model, old, new = updated(alice, registry, weights[2])
    code, out, err = ctl("alice", "model", "rollback", model.name)
    assert code == 0, err
    advance_rollouts()  # what beat does: no replicas, so the rollback is done at once
    assert Rollout.objects.filter(model=model).first().state == Rollout.DONE

    code, out, err = ctl("bob", "model", "updates", "--json")
    assert code == 0, err
    [update] = json.loads(out)["updates"]
    size = weights[2].stat().st_size
    assert update["model"] == model.name
    assert (update["current_commit"], update["new_commit"]) == (old, new)
    assert [(f["path"], f["size"]) for f in update["files"]] == [("tiny-chat-q4.gguf", size)]
    assert (update["bytes"], update["rolled_back_from"], update["error"]) == (size, new, None)

    code, out, err = ctl("bob", "model", "updates")
    assert code == 0, err
    assert "Every served model is on the newest files" not in out
    row = out.splitlines()[1]
    assert row.split()[:3] == [model.name, old[:7], new[:7]]
    assert out.splitlines()[2] == (
        f"{model.name} was rolled back from {new[:7]}; "
        f"`llmgw ctl model update {model.name}` moves it to {new[:7]} again."
    )

    client = Client()
    client.force_login(users["alice"])
    page = client.get("/").content.decode()
    assert f"update available: {old[:7]} → {new[:7]}, 1 file" in page

    # The next check finds the branch where the rollback left it: the update stays.
    check_updates()
    model.refresh_from_db()
    assert model.update_available["commit"] == new
    # And the update it offers works: the model is on the newest files again, nothing left.
    code, out, err = ctl("alice", "model", "update", model.name)
    assert code == 0, err
    rollout = Rollout.objects.filter(model=model).first()
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    model.refresh_from_db()
    assert (model.origin["commit"], model.update_available) == (new, None)
    code, out, err = ctl("bob", "model", "updates", "--json")
    assert json.loads(out)["updates"] == []


def test_it_offers_a_newer_revision_the_check_saw_compared_with_the_files_rolled_back_to(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path], tmp_path: Path
) -> None:
    model, old, new = updated(alice, registry, weights[2])
    newest_weights = tmp_path / "newest.gguf"
    newest_weights.write_bytes(weights[1].read_bytes() + b"\0" * 64)
    newest = registry.commit(REPO, {"tiny-chat-q4.gguf": newest_weights})
    check_updates()
    start_rollback(actor=alice, name=model.name)
    model.refresh_from_db()
    assert model.origin["commit"] == old
    update = model.update_available
    assert (update["commit"], update["rolled_back_from"]) == (newest, new)
    assert [f["size"] for f in update["files"]] == [newest_weights.stat().st_size]
    advance_rollouts()
    rollout = start_update(actor=alice, name=model.name)
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    model.refresh_from_db()
    assert (model.origin["commit"], model.update_available) == (newest, None)


def test_a_rollback_of_a_rollback_leaves_no_update_and_a_third_offers_it_again(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path]
) -> None:
    model, old, new = updated(alice, registry, weights[2])
    start_rollback(actor=alice, name=model.name)
    advance_rollouts()
    model.refresh_from_db()
    assert (model.origin["commit"], model.update_available["commit"]) == (old, new)
    start_rollback(actor=alice, name=model.name)  # back to the newest: nothing newer
    advance_rollouts()
    model.refresh_from_db()
    assert (model.origin["commit"], model.update_available) == (new, None)
    start_rollback(actor=alice, name=model.name)
    model.refresh_from_db()
    assert (model.origin["commit"], model.update_available["commit"]) == (old, new)
