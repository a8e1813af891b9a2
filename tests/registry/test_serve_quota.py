"""A plain user's serves hold at most LLMGW_SERVE_QUOTA_GB of the mirror (registry.quota),
against olah on git-lfs repos: the sizes are the registry's, the files the mirror's."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import current_app
from django.utils import timezone

from catalog.models import Model
from catalog.services import model_remove
from core.actor import Actor
from core.refusals import Refused
from llmgw.units import format_bytes
from registry import mirror
from registry.models import Fetch, MirrorFile
from registry.quota import GB
from registry.rollouts import start_update
from registry.updates import check_updates, finish_serve, serve_start
from tests.registry.serving import REPO, serve
from tests.support.registry import LocalRegistry, available

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

# Each test weights file is 489.56 KB: one fits in 600 KB, two do not.
QUOTA_KB = 600
WAY_OUT = (
    "Remove models of yours that you no longer use (`llmgw ctl model remove NAME`; the mirror "
    "then deletes the files nothing else uses), or ask a staff user to do it for you, or the "
    "operator to raise LLMGW_SERVE_QUOTA_GB."
)


@pytest.fixture(autouse=True)
def quota(settings: Any) -> None:
    settings.LLMGW_SERVE_QUOTA_GB = QUOTA_KB * 1024 / GB


@pytest.fixture
def q8(registry: LocalRegistry, weights: dict[int, Path]) -> str:
    """A second GGUF file in the repository, at a new head; the pattern that names it."""
    registry.commit(REPO, {"tiny-chat-q8.gguf": weights[2]})
    return "*q8*"


@pytest.fixture
def sent() -> Iterator[list[str]]:
    """The names of the tasks queued, with a broker that only listens."""
    names: list[str] = []
    app = current_app._get_current_object()
    original = app.send_task
    app.send_task = lambda name, args=(), **_: names.append(name)
    try:
        yield names
    finally:
        app.send_task = original


def refusal(doing: str, path: str, size: int, used: int) -> str:
    return (
        f"Cannot {doing}: it would bring {path} ({format_bytes(size)}) into the mirror, and the "
        f"files your serves hold there already come to {format_bytes(used)} of your quota of "
        f"{QUOTA_KB:.2f} KB (LLMGW_SERVE_QUOTA_GB). {WAY_OUT}"
    )


def as_user(users: dict[str, Any], name: str) -> Actor:
    return Actor.for_user(users[name], "cli")


def test_a_serve_past_the_quota_is_refused_before_anything_is_fetched(
    registry: LocalRegistry, api: Any, settings: Any, weights: dict[int, Path]
) -> None:
    size = weights[1].stat().st_size
    settings.LLMGW_SERVE_QUOTA_GB = 400 * 1024 / GB
    response = api("alice").post("/api/v1/serve", {"repo": REPO}, format="json")
    assert response.status_code == 409
    assert response.json() == {
        "detail": f"Cannot serve {REPO}: it would bring tiny-chat-q4.gguf ({format_bytes(size)}) "
        "into the mirror, and the files your serves hold there already come to 0 B of your "
        f"quota of 400.00 KB (LLMGW_SERVE_QUOTA_GB). {WAY_OUT}",
        "code": "serve_quota",
    }
    assert not Fetch.objects.exists() and not Model.objects.exists()
    # Staff have no quota.
    assert api("staff").post("/api/v1/serve", {"repo": REPO}, format="json").status_code == 202


def test_a_quota_of_0_leaves_serving_to_staff(
    registry: LocalRegistry, api: Any, settings: Any
) -> None:
    settings.LLMGW_SERVE_QUOTA_GB = 0
    response = api("alice").post("/api/v1/serve", {"repo": REPO}, format="json")
    assert response.status_code == 403
    assert response.json() == {
        "detail": f"Cannot serve {REPO}: serving from the registry is left to staff here "
        "(LLMGW_SERVE_QUOTA_GB is 0). Ask a staff user to serve it for you, or the operator to "
        "set a quota.",
        "code": "forbidden",
    }
    assert not Fetch.objects.exists()
    assert api("staff").post("/api/v1/serve", {"repo": REPO}, format="json").status_code == 202


def test_what_counts_is_what_each_users_serves_hold_in_the_mirror_or_are_fetching(
    q8: str, users: dict[str, Any], weights: dict[int, Path]
) -> None:
    size = weights[1].stat().st_size
    alice, bob = as_user(users, "alice"), as_user(users, "bob")
    serve(alice, pattern="*q4*")
    with pytest.raises(Refused) as refused:
        serve_start(actor=alice, repo=REPO, pattern=q8)
    assert refused.value.message == refusal(f"serve {REPO}", "tiny-chat-q8.gguf", size, size)
    assert refused.value.status == 409
    # The same file again, under another name, brings nothing new into the mirror.
    assert serve(alice, pattern="*q4*", name="same-weights").owner == users["alice"]
    # Each user has a quota of their own; a fetch still under way counts.
    serve_start(actor=bob, repo=REPO, pattern=q8)
    with pytest.raises(Refused) as refused:
        serve_start(actor=bob, repo=REPO, pattern="*q4*", name="bobs-q4")
    assert refused.value.message == refusal(f"serve {REPO}", "tiny-chat-q4.gguf", size, size)
    assert Fetch.objects.filter(requested_by=users["bob"]).count() == 1


def test_removing_a_model_gives_its_share_back_once_the_mirror_deletes_its_files(
    q8: str,
    users: dict[str, Any],
    settings: Any,
    sent: list[str],
    django_capture_on_commit_callbacks: Any,
) -> None:
    alice = as_user(users, "alice")
    served = serve(alice, pattern="*q4*")
    settings.LLMGW_KICK_RECONCILE = True
    with django_capture_on_commit_callbacks(execute=True):
        model_remove(actor=alice, name=served.name)
    assert "registry.tasks.clean_mirror" in sent
    # Until the task runs, the file is still in the mirror and still counts.
    with pytest.raises(Refused, match=r"already come to 489\.56 KB"):
        serve_start(actor=alice, repo=REPO, pattern=q8)
    # What the task does, once the fetch is no longer fresh (a serve's model is added just
    # after its fetch is done: the mirror keeps the files of a recent one meanwhile).
    Fetch.objects.update(finished_at=timezone.now() - timedelta(minutes=11))
    assert mirror.clean_mirror() == [served.source.split("/mirror/", 1)[1]]
    assert not MirrorFile.objects.exists()
    assert serve(alice, pattern=q8).owner == users["alice"]


def test_a_cleaning_between_a_serves_fetch_and_its_model_keeps_the_files(
    registry: LocalRegistry, users: dict[str, Any]
) -> None:
    """Cleanings now follow every removal, so one may fall in the moment between a serve's fetch
    being done and its model being added: the files must survive it."""
    fetch = serve_start(actor=as_user(users, "alice"), repo=REPO)
    assert mirror.download(fetch.pk)  # done; the model is added next (fetches.run_fetch)
    assert mirror.clean_mirror() == []
    fetch.refresh_from_db()
    finish_serve(fetch)
    model = Model.objects.get()
    path = mirror.parse_mirror_url(model.source)
    assert path is not None and mirror.local_path(*path).exists()


def test_an_update_is_held_to_the_quota_too(
    registry: LocalRegistry, users: dict[str, Any], weights: dict[int, Path]
) -> None:
    alice = as_user(users, "alice")
    served = serve(alice)
    registry.commit(REPO, {"tiny-chat-q4.gguf": weights[2]})
    assert check_updates().updates == [served.name]
    with pytest.raises(Refused) as refused:
        start_update(actor=alice, name=served.name)
    size = weights[2].stat().st_size
    assert refused.value.message == refusal(
        f"update {served.name}", "tiny-chat-q4.gguf", size, weights[1].stat().st_size
    )
    assert Fetch.objects.count() == 1
    # Staff may.
    assert start_update(actor=as_user(users, "staff"), name=served.name).fetch is not None
