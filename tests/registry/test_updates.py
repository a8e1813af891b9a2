"""Serving from the registry and the update check, against olah on git-lfs repos."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import current_app

from catalog.models import AuditEntry, Model
from core.actor import Actor
from core.refusals import Refused
from registry import fetches, mirror
from registry.models import LEASE_SECONDS, Fetch, MirrorFile
from registry.updates import check_updates, serve_start
from tests.registry.serving import REPO, serve
from tests.support.registry import LocalRegistry, available
from tests.support.tiny_hf import make_tiny_llama

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]


def test_serve_fetches_into_the_mirror_and_records_the_origin(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path]
) -> None:
    model = serve(alice)
    commit = registry.first_commit  # type: ignore[attr-defined]
    assert model.name == "tiny-chat-q4"
    assert model.owner.username == "alice"
    assert model.source.endswith(f"/mirror/{REPO}/{commit}/tiny-chat-q4.gguf")
    sha = MirrorFile.objects.get().sha256
    assert model.origin == {
        "repo": REPO,
        "branch": "main",
        "commit": commit,
        "files": [{"path": "tiny-chat-q4.gguf", "sha256": sha, "size": weights[1].stat().st_size}],
    }
    local = mirror.local_path(REPO, commit, "tiny-chat-q4.gguf")
    assert local.read_bytes() == weights[1].read_bytes()
    assert Fetch.objects.get().bytes_done == weights[1].stat().st_size
    entry = AuditEntry.objects.get(action="add")
    assert (entry.actor_name, entry.door) == ("alice", "cli")


def test_serve_refuses_a_glob_that_matches_nothing_or_too_much(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path]
) -> None:
    with pytest.raises(Refused, match="has no GGUF file matching '\\*q8\\*'"):
        serve_start(actor=alice, repo=REPO, pattern="*q8*")
    registry.commit(REPO, {"tiny-chat-q8.gguf": weights[2]})
    with pytest.raises(Refused, match="2 GGUF files of acme/tiny-chat-GGUF match"):
        serve_start(actor=alice, repo=REPO)
    with pytest.raises(Refused, match="has no branch 'dev'"):
        serve_start(actor=alice, repo=REPO, branch="dev")
    assert not Fetch.objects.exists()


def test_the_check_asks_once_per_repository_and_ignores_commits_that_touch_no_served_file(
    registry: LocalRegistry, alice: Actor
) -> None:
    serve(alice)
    report = check_updates()
    assert report.requests == 1 and report.updates == []
    registry.commit(REPO, {"README.md": b"# changed\n"})
    report = check_updates()
    assert report.updates == []
    assert Model.objects.get().update_available is None
    assert check_updates().requests == 1  # the head it already looked at is not asked about again


def test_new_weights_are_an_update_with_the_changed_file(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path]
) -> None:
    serve(alice)
    new_commit = registry.commit(REPO, {"tiny-chat-q4.gguf": weights[2]})
    report = check_updates()
    assert report.updates == ["tiny-chat-q4"] and report.requests == 2
    update = Model.objects.get().update_available
    assert update["commit"] == new_commit
    assert [(f["path"], f["size"]) for f in update["files"]] == [
        ("tiny-chat-q4.gguf", weights[2].stat().st_size)
    ]


def test_a_registry_that_is_down_is_recorded_and_tried_again(
    registry: LocalRegistry, alice: Actor
) -> None:
    serve(alice)
    registry.stop()
    report = check_updates()
    assert REPO in report.failures
    model = Model.objects.get()
    assert model.update_check_error.startswith("last check failed: the registry at")
    registry.start()
    check_updates()
    assert Model.objects.get().update_check_error == ""


def test_an_interrupted_fetch_is_claimed_again(registry: LocalRegistry, alice: Actor) -> None:
    from datetime import timedelta

    from django.utils import timezone

    fetch = serve_start(actor=alice, repo=REPO)
    assert mirror.claim_fetch(fetch.pk)
    assert not mirror.claim_fetch(fetch.pk)  # another worker holds it
    Fetch.objects.filter(pk=fetch.pk).update(heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert mirror.claim_fetch(fetch.pk)  # its worker died: taken over
    Fetch.objects.filter(pk=fetch.pk).update(heartbeat_at=timezone.now() - timedelta(minutes=5))
    fetches.run_fetch(fetch.pk)
    assert Fetch.objects.get(pk=fetch.pk).state == Fetch.DONE


def test_a_fetch_goes_on_when_the_database_fails_for_a_moment(
    registry: LocalRegistry, alice: Actor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL restarting during a fetch (the fault matrix's postgres x serve and x
    update-fetch): its progress is not written, its end is written once the database answers
    again, and it ends done, not left running until its lease lapses (LEASE_SECONDS)."""
    from django.db import OperationalError

    fetch = serve_start(actor=alice, repo=REPO)
    failed = {"beat": 0, "finish": 0}
    finish = Fetch.finish

    def beat(self: Fetch, *args: Any, **kwargs: Any) -> None:
        failed["beat"] += 1
        raise OperationalError("terminating connection due to administrator command")

    def finish_once_failing(self: Fetch) -> None:
        if not failed["finish"]:
            failed["finish"] += 1
            raise OperationalError("the database system is starting up")
        finish(self)

    monkeypatch.setattr(Fetch, "beat", beat)
    monkeypatch.setattr(Fetch, "finish", finish_once_failing)
    monkeypatch.setattr(mirror, "PROGRESS_EVERY_SECONDS", -1.0)  # progress at every chunk
    fetches.run_fetch(fetch.pk)
    assert Fetch.objects.get(pk=fetch.pk).state == Fetch.DONE
    assert failed["beat"] >= 2 and failed["finish"] == 1
    assert Model.objects.filter(name="tiny-chat-q4").exists()


def test_a_fetch_whose_database_stays_away_is_left_to_be_taken_over(
    registry: LocalRegistry, alice: Actor, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.db import OperationalError

    fetch = serve_start(actor=alice, repo=REPO)

    def finish(self: Fetch) -> None:
        raise OperationalError("the database system is shutting down")

    monkeypatch.setattr(Fetch, "finish", finish)
    monkeypatch.setattr(mirror, "DATABASE_RETRY_SECONDS", 0.5)
    with pytest.raises(OperationalError):
        fetches.run_fetch(fetch.pk)
    assert Fetch.objects.get(pk=fetch.pk).state == Fetch.RUNNING  # taken over once stale


def test_a_serve_fetch_nobody_runs_is_queued_again(
    registry: LocalRegistry, alice: Actor, settings: Any
) -> None:
    """Its message lost (a broker restart, a task renamed by an upgrade) or its worker gone, a
    `model serve` would otherwise wait for ever: beat's pass queues it again."""
    from datetime import timedelta

    from django.utils import timezone

    sent: list[tuple[str, tuple[Any, ...]]] = []
    settings.LLMGW_KICK_RECONCILE = True
    app = current_app._get_current_object()
    original = app.send_task
    app.send_task = lambda name, args=(), **_: sent.append((name, tuple(args)))
    try:
        lost = serve_start(actor=alice, repo=REPO)  # its message goes on commit: never here
        now = timezone.now()
        assert fetches.resume_interrupted(now=now) == []  # just queued: a worker may take it
        later = now + timedelta(seconds=fetches.RESUME_AFTER_SECONDS + 1)
        assert fetches.resume_interrupted(now=later) == [lost.pk]
        assert sent == [("registry.tasks.run_fetch", (lost.pk,))]
        assert fetches.resume_interrupted(now=later) == []  # once per RESUME_AFTER_SECONDS

        assert mirror.claim_fetch(lost.pk)  # a worker takes it, and dies
        Fetch.objects.filter(pk=lost.pk).update(heartbeat_at=now)
        dead = now + timedelta(seconds=LEASE_SECONDS + 1)
        assert fetches.resume_interrupted(now=dead) == [lost.pk]
        assert Fetch.objects.get(pk=lost.pk).state == Fetch.QUEUED
    finally:
        app.send_task = original
    fetches.run_fetch(lost.pk)  # what the queued message does
    assert Fetch.objects.get(pk=lost.pk).state == Fetch.DONE
    assert fetches.resume_interrupted(now=dead + timedelta(hours=1)) == []
    assert Model.objects.filter(name=lost.serve_definition["name"]).exists()


def test_a_model_added_by_mirror_url_gets_its_origin_from_the_mirror_record(
    registry: LocalRegistry, alice: Actor
) -> None:
    from catalog.definitions import clean_definition
    from catalog.services import model_add

    served = serve(alice)
    by_url = model_add(
        actor=alice,
        definition=clean_definition(
            {
                "name": "same-weights",
                "source": served.source,
                "profiles": [{"name": "cpu", "memory_gb": 1}],
            }
        ),
        source_check=False,
    )
    assert by_url.origin == served.origin


def test_serve_for_vllm_takes_the_snapshot_and_refuses_a_repository_that_is_not_one(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path], tmp_path: Path
) -> None:
    # A repository of GGUF files is no Hugging Face snapshot: no config.json, no safetensors.
    with pytest.raises(Refused, match=r"has no config\.json among the files"):
        serve_start(actor=alice, repo=REPO, engine="vllm")
    with pytest.raises(Refused, match="takes no separate projector file"):
        serve_start(actor=alice, repo=REPO, engine="vllm", mmproj="mmproj.gguf")
    assert not Fetch.objects.exists()

    snapshot = make_tiny_llama(tmp_path / "snap", seed=1, shards=2)
    files = {p.name: p for p in snapshot.iterdir()}
    registry.commit("acme/tiny-llama", {**files, "README.md": weights[1]})
    fetch = serve_start(actor=alice, repo="acme/tiny-llama", engine="vllm")
    definition = fetch.serve_definition
    assert definition["engine"] == "vllm" and definition["source"].endswith("/config.json")
    # Every file of the snapshot but its entry, and nothing else of the repository.
    assert sorted(definition["files"]) == sorted(set(files) - {"config.json"})
    assert fetch.files[0]["path"] == "config.json"
