"""Update and rollback: fetching beside the old files, swapping, replacing replicas, going back."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import pytest

from catalog.models import AuditEntry, Model
from catalog.services import model_scale
from core import metrics as core_metrics
from core.actor import Actor
from core.refusals import Refused
from registry import fetches, mirror
from registry.models import MirrorFile, Rollout
from registry.rollouts import advance_rollouts, start_rollback, start_update
from registry.updates import check_updates
from tests.registry.serving import REPO, serve
from tests.support.registry import LocalRegistry, available

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]


def test_fetches_are_counted_with_the_bytes_they_downloaded(
    registry: LocalRegistry, alice: Actor, weights: dict[int, Path]
) -> None:
    """llmgw_fetches_total, llmgw_fetch_bytes_total and llmgw_fetch_duration_seconds, counted
    where the fetch runs, once per fetch however often it is asked for."""
    core_metrics.reset_for_tests()
    board = core_metrics.control_metrics()
    model = serve(alice)
    size = weights[1].stat().st_size
    assert board.fetches.labels("done")._value.get() == 1
    assert board.fetch_bytes._value.get() == size
    assert board.fetch_seconds._sum.get() > 0
    model_scale(actor=alice, name=model.name, min_replicas=0, max_replicas=0)
    registry.commit(REPO, {"tiny-chat-q4.gguf": weights[2]})
    check_updates()
    rollout = start_update(actor=alice, name=model.name)
    fetches.run_fetch(rollout.fetch_id)
    assert board.fetches.labels("done")._value.get() == 2
    assert board.fetch_bytes._value.get() == size + weights[2].stat().st_size
    # The fetch asked again (a message delivered twice): nothing downloaded, nothing counted.
    fetches.run_fetch(rollout.fetch_id)
    assert board.fetches.labels("done")._value.get() == 2
    core_metrics.reset_for_tests()


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
    with pytest.raises(Refused) as caught:
        start_update(actor=Actor.for_user(users["staff"], "api"), name=model.name)
    assert caught.value.status == 409
    assert caught.value.message.startswith(
        "An update of tiny-chat-q4 is already under way (asked by alice, fetching)"
    )


def test_update_and_rollback_refusals(
    registry: LocalRegistry, alice: Actor, users: dict[str, Any]
) -> None:
    model = serve(alice)
    with pytest.raises(Refused, match="No newer weights are known for tiny-chat-q4"):
        start_update(actor=alice, name=model.name)
    with pytest.raises(Refused, match="has no previous weights to go back to"):
        start_rollback(actor=alice, name=model.name)
    with pytest.raises(Refused, match="belongs to alice"):
        start_rollback(actor=Actor.for_user(users["bob"], "api"), name=model.name)


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
