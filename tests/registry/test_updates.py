"""Serving from the registry, the update check, update and rollback, against olah on git-lfs repos."""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from catalog.errors import CatalogError
from catalog.models import AuditEntry, Model
from catalog.services import Actor, model_scale
from llmgw.tinygguf import write_tiny_model
from registry import fetches, mirror
from registry.models import Fetch, MirrorFile, Rollout
from registry.rollouts import advance_rollouts, start_rollback, start_update
from registry.updates import check_updates, serve_start
from tests.support.registry import LocalRegistry, available

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

REPO = "acme/tiny-chat-GGUF"


@pytest.fixture
def weights(tmp_path: Path) -> dict[int, Path]:
    paths = {}
    for seed in (1, 2):
        paths[seed] = tmp_path / f"weights-{seed}.gguf"
        write_tiny_model(paths[seed], seed=seed)
    return paths


@pytest.fixture
def registry(tmp_path: Path, server_yaml: Any, weights: dict[int, Path]) -> Iterator[LocalRegistry]:
    with LocalRegistry(tmp_path / "registry") as running:
        running.first_commit = running.commit(REPO, {"tiny-chat-q4.gguf": weights[1]})  # type: ignore[attr-defined]
        server_yaml(
            {
                "registry": {"endpoint": running.endpoint},
                "mirror": {"root": str(tmp_path / "mirror")},
            }
        )
        yield running


@pytest.fixture
def alice(users: dict[str, Any]) -> Actor:
    return Actor.for_user(users["alice"], "cli")


def serve(alice: Actor, **options: Any) -> Model:
    fetch = serve_start(actor=alice, repo=REPO, **options)
    fetches.run_fetch(fetch.pk)
    fetch.refresh_from_db()
    assert fetch.state == Fetch.DONE, fetch.message
    return Model.objects.get(name=fetch.serve_definition["name"])


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
    with pytest.raises(CatalogError, match="has no GGUF file matching '\\*q8\\*'"):
        serve_start(actor=alice, repo=REPO, pattern="*q8*")
    registry.commit(REPO, {"tiny-chat-q8.gguf": weights[2]})
    with pytest.raises(CatalogError, match="2 GGUF files of acme/tiny-chat-GGUF match"):
        serve_start(actor=alice, repo=REPO)
    with pytest.raises(CatalogError, match="has no branch 'dev'"):
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


def test_update_fetches_beside_the_old_files_swaps_and_rollback_goes_back(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path]
) -> None:
    model = serve(alice)
    old_source, old_commit = model.source, model.origin["commit"]
    model_scale(
        actor=alice, name=model.name, min_replicas=0, max_replicas=0
    )  # no replicas to wait for here
    new_commit = registry.commit(REPO, {"tiny-chat-q4.gguf": weights[2]})
    check_updates()
    rollout = start_update(actor=alice, name=model.name)
    assert rollout.state == Rollout.FETCHING
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    model.refresh_from_db()
    assert model.source.endswith(f"/{new_commit}/tiny-chat-q4.gguf")
    assert model.previous["source"] == old_source and model.update_available is None
    assert mirror.local_path(REPO, old_commit, "tiny-chat-q4.gguf").exists()  # kept for a rollback
    assert Rollout.objects.get(pk=rollout.pk).state == Rollout.DONE
    back = start_rollback(actor=alice, name=model.name)
    assert (back.from_commit, back.to_commit) == (new_commit, old_commit)
    model.refresh_from_db()
    assert model.source == old_source and model.origin["commit"] == old_commit
    advance_rollouts()
    assert Rollout.objects.get(pk=back.pk).state == Rollout.DONE
    actions = list(
        AuditEntry.objects.filter(model_name=model.name)
        .order_by("id")
        .values_list("action", "actor_name")
    )
    assert ("update", "alice") in actions and ("update-swap", "alice") in actions
    assert ("update-done", "system") in actions and ("rollback", "alice") in actions


def test_a_checksum_mismatch_refuses_the_update_and_changes_nothing(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path]
) -> None:
    model = serve(alice)
    registry.commit(REPO, {"tiny-chat-q4.gguf": weights[2]})
    check_updates()
    # The registry now serves bytes that do not match the sha256 it lists.
    new_sha = Model.objects.get().update_available["files"][0]["sha256"]
    [obj] = glob.glob(str(registry.repos / "models" / REPO / ".git/lfs/objects/*/*" / new_sha))
    data = bytearray(Path(obj).read_bytes())
    data[200] ^= 0xFF
    Path(obj).write_bytes(bytes(data))
    rollout = start_update(actor=alice, name=model.name)
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    rollout.refresh_from_db()
    assert rollout.state == Rollout.FAILED
    assert (
        "refused, the model is unchanged: sha256 mismatch for tiny-chat-q4.gguf" in rollout.message
    )
    after = Model.objects.get()
    assert after.source == model.source and after.previous is None
    new_dir = mirror.local_path(REPO, rollout.to_commit, "x").parent
    assert not new_dir.exists() or not any(new_dir.iterdir())  # no file that looks complete


def test_two_updates_of_one_model_at_once_are_refused(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path], users: dict[str, Any]
) -> None:
    model = serve(alice)
    registry.commit(REPO, {"tiny-chat-q4.gguf": weights[2]})
    check_updates()
    start_update(actor=alice, name=model.name)
    with pytest.raises(CatalogError) as caught:
        start_update(actor=Actor.for_user(users["staff"], "api"), name=model.name)
    assert caught.value.status == 409
    assert caught.value.message.startswith(
        "An update of tiny-chat-q4 is already under way (asked by alice, fetching)"
    )


def test_update_and_rollback_refusals(
    registry: LocalRegistry, alice: Actor, users: dict[str, Any]
) -> None:
    model = serve(alice)
    with pytest.raises(CatalogError, match="No newer weights are known for tiny-chat-q4"):
        start_update(actor=alice, name=model.name)
    with pytest.raises(CatalogError, match="has no previous weights to go back to"):
        start_rollback(actor=alice, name=model.name)
    with pytest.raises(CatalogError, match="belongs to alice"):
        start_rollback(actor=Actor.for_user(users["bob"], "api"), name=model.name)


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


def test_the_mirror_keeps_what_models_and_their_previous_revisions_use(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path]
) -> None:
    model = serve(alice)
    first = model.origin["commit"]
    model_scale(actor=alice, name=model.name, min_replicas=0, max_replicas=0)
    commits = [first]
    for seed in (2, 1, 2):
        registry.commit(REPO, {"tiny-chat-q4.gguf": weights[seed]}, message=f"seed {seed}")
        check_updates()
        rollout = start_update(actor=alice, name=model.name)
        fetches.run_fetch(rollout.fetch_id)
        advance_rollouts()
        advance_rollouts()
        commits.append(Rollout.objects.get(pk=rollout.pk).to_commit)
    kept = set(MirrorFile.objects.values_list("commit", flat=True))
    assert kept == {commits[-1], commits[-2]}  # current and previous; older ones cleaned
    assert not mirror.local_path(REPO, first, "tiny-chat-q4.gguf").exists()


def test_a_new_replica_that_keeps_failing_halts_the_update_and_rollback_works_from_there(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path], users: dict[str, Any]
) -> None:
    from fleet.models import Replica
    from fleet.reconciler import MAX_START_FAILURES, reconcile_pass
    from tests.support.fleet import Fleet

    fleet = Fleet(users["staff"], users["alice"])
    fleet.node("a", memory_gb=8)
    model = serve(alice)
    reconcile_pass()
    fleet.beat("a")
    [old] = fleet.replicas(model.name)
    registry.commit(REPO, {"tiny-chat-q4.gguf": weights[2]})
    check_updates()
    rollout = start_update(actor=alice, name=model.name)
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    for _ in range(MAX_START_FAILURES):
        reconcile_pass()
        [new] = [r for r in fleet.replicas(model.name) if r.pk != old.pk]
        fleet.beat("a", states={str(old.pk): "ready", str(new.pk): "failed"})
        Replica.objects.filter(pk=new.pk).update(message="the engine exited with code 139")
    reconcile_pass()
    advance_rollouts()
    rollout.refresh_from_db()
    assert rollout.state == Rollout.HALTED
    assert "failed to become ready 3 times" in rollout.message and "rollback" in rollout.message
    assert Replica.objects.get(pk=old.pk).routable  # the old replica keeps serving
    back = start_rollback(actor=alice, name=model.name)
    reconcile_pass()
    advance_rollouts()
    assert Rollout.objects.get(pk=back.pk).state == Rollout.DONE
    assert [r.pk for r in fleet.replicas(model.name)] == [old.pk]  # already on the old files
