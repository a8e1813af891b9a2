"""A model's vision projector (mmproj) in the mirror: fetched with the weights at their commit,
moved to the new commit by an update (even one that changes only the projector) and back by a
rollback, kept while a revision refers to it, and part of the revision replicas run."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from catalog.models import Model
from catalog.services import model_remove, model_scale
from core.actor import Actor
from core.refusals import Refused
from fleet.specs import model_revision, replica_revision, replica_spec, weights_revision
from llmgw.tinygguf import write_tiny_mmproj
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

MMPROJ = "mmproj-tiny-f32.gguf"
WEIGHTS = "tiny-chat-q4.gguf"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def projectors(tmp_path: Path) -> dict[int, Path]:
    paths = {}
    for seed in (1, 2):
        paths[seed] = tmp_path / f"mmproj-{seed}.gguf"
        write_tiny_mmproj(paths[seed], seed=seed)
    return paths


@pytest.fixture
def vision_repo(registry: LocalRegistry, projectors: dict[int, Path]) -> str:
    """The registry's repository with the first projector beside the first weights."""
    return registry.commit(REPO, {MMPROJ: projectors[1]}, message="add the projector")


def _in_mirror(commit: str, path: str) -> Path:
    return mirror.local_path(REPO, commit, path)


def _served(alice: Actor) -> Model:
    # "*.gguf" names the weights alone: the projector it would also match is not counted.
    model = serve(alice, mmproj=MMPROJ)
    model_scale(actor=alice, name=model.name, min_replicas=0, max_replicas=0)
    model.refresh_from_db()
    return model


def _spec(model: Model) -> dict[str, Any]:
    return replica_spec(model, model.profiles[0])


def test_serve_fetches_the_projector_beside_the_weights(
    vision_repo: str, alice: Actor, projectors: dict[int, Path], weights: dict[int, Path]
) -> None:
    model = _served(alice)
    assert model.mmproj == MMPROJ
    assert model.definition()["mmproj"] == MMPROJ
    assert model.source.endswith(f"/{vision_repo}/{WEIGHTS}")
    assert _in_mirror(vision_repo, MMPROJ).read_bytes() == projectors[1].read_bytes()
    record = MirrorFile.objects.get(repo=REPO, commit=vision_repo, path=MMPROJ)
    assert record.sha256 == _sha(projectors[1])
    # The origin follows both files; the replica is told the projector at the same commit.
    assert {f["path"] for f in model.origin["files"]} == {WEIGHTS, MMPROJ}
    spec = _spec(model)
    assert spec["mmproj"] == {
        "path": MMPROJ,
        "source": mirror.file_url(REPO, vision_repo, MMPROJ),
        "sha256": _sha(projectors[1]),
    }
    # The serve's default memory counts the projector with the weights.
    size_gib = (weights[1].stat().st_size + projectors[1].stat().st_size) / 2**30
    assert model.profiles[0]["memory_gb"] >= size_gib
    # The revision is the pair's: the same weights without the projector are another one.
    assert replica_revision(spec) == model_revision(model)
    assert replica_revision(spec) != weights_revision(model.source, model.sha256)


def test_a_new_projector_alone_is_an_update_and_a_rollback_brings_the_old_one_back(
    vision_repo: str,
    registry: LocalRegistry,
    alice: Actor,
    projectors: dict[int, Path],
    weights: dict[int, Path],
) -> None:
    model = _served(alice)
    old_revision = model_revision(model)
    new_commit = registry.commit(REPO, {MMPROJ: projectors[2]}, message="better projector")

    report = check_updates()
    assert report.updates == [model.name]
    model.refresh_from_db()
    assert [f["path"] for f in model.update_available["files"]] == [MMPROJ]

    rollout = start_update(actor=alice, name=model.name)
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    advance_rollouts()
    assert Rollout.objects.get(pk=rollout.pk).state == Rollout.DONE
    model.refresh_from_db()
    assert model.source.endswith(f"/{new_commit}/{WEIGHTS}")
    assert model.sha256 == _sha(weights[1])  # the weights did not change
    assert _in_mirror(new_commit, MMPROJ).read_bytes() == projectors[2].read_bytes()
    assert _spec(model)["mmproj"]["source"] == mirror.file_url(REPO, new_commit, MMPROJ)
    assert _spec(model)["mmproj"]["sha256"] == _sha(projectors[2])
    assert model_revision(model) != old_revision
    # The old projector stays in the mirror for a rollback (the update's end cleaned it).
    assert _in_mirror(vision_repo, MMPROJ).exists()

    back = start_rollback(actor=alice, name=model.name)
    advance_rollouts()
    assert Rollout.objects.get(pk=back.pk).state == Rollout.DONE
    model.refresh_from_db()
    assert _spec(model)["mmproj"]["source"] == mirror.file_url(REPO, vision_repo, MMPROJ)
    assert _spec(model)["mmproj"]["sha256"] == _sha(projectors[1])
    assert model_revision(model) == old_revision
    assert _in_mirror(vision_repo, MMPROJ).read_bytes() == projectors[1].read_bytes()


def test_new_weights_bring_the_projector_to_their_commit(
    vision_repo: str, registry: LocalRegistry, alice: Actor, weights: dict[int, Path],
    projectors: dict[int, Path],
) -> None:  # fmt: skip
    model = _served(alice)
    new_commit = registry.commit(REPO, {WEIGHTS: weights[2]}, message="retrained")
    check_updates()
    rollout = start_update(actor=alice, name=model.name)
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    model.refresh_from_db()
    assert model.sha256 == _sha(weights[2])
    # The unchanged projector is in the mirror at the new commit too, so that the replica's
    # weights and projector come from one commit.
    assert _in_mirror(new_commit, MMPROJ).read_bytes() == projectors[1].read_bytes()
    assert _spec(model)["mmproj"]["source"] == mirror.file_url(REPO, new_commit, MMPROJ)


def test_the_mirror_keeps_the_projectors_a_model_refers_to(
    vision_repo: str, registry: LocalRegistry, alice: Actor, projectors: dict[int, Path]
) -> None:
    model = _served(alice)
    new_commit = registry.commit(REPO, {MMPROJ: projectors[2]})
    check_updates()
    rollout = start_update(actor=alice, name=model.name)
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    keep = mirror.referenced_files()
    assert (REPO, vision_repo, MMPROJ) in keep  # the previous revision's
    assert (REPO, new_commit, MMPROJ) in keep  # the current one's
    assert mirror.clean_mirror() == []
    model_remove(actor=alice, name=model.name)
    removed = mirror.clean_mirror()
    # (The serve's own files stay a while longer: registry.mirror keeps a serve's files for
    # minutes after its fetch, as though it were under way.)
    assert f"{REPO}/{new_commit}/{MMPROJ}" in removed
    assert not _in_mirror(new_commit, MMPROJ).exists()


def test_serving_a_projector_the_repository_does_not_have_is_refused(
    vision_repo: str, alice: Actor
) -> None:
    with pytest.raises(Refused) as caught:
        serve(alice, pattern=WEIGHTS, mmproj="vision/missing.gguf")
    assert caught.value.code == "no_mmproj"
    assert caught.value.message == (
        f"{REPO} has no file 'vision/missing.gguf' at {vision_repo[:7]} to serve as the vision "
        "projector. Name the projector's .gguf file by its path in the repository, or leave "
        "mmproj out."
    )
    assert not Model.objects.exists()


def test_a_canary_of_a_new_projector_is_judged_by_the_pair_of_files(
    vision_repo: str, registry: LocalRegistry, alice: Actor, projectors: dict[int, Path]
) -> None:
    from registry import canary

    model = _served(alice)
    old_revision = model_revision(model)
    registry.commit(REPO, {MMPROJ: projectors[2]}, message="better projector")
    check_updates()
    rollout = canary.start_canary_update(
        actor=alice, name=model.name, settings_=canary.canary_settings(percent=20)
    )
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    model.refresh_from_db()
    # The revision the gateway counts the canary's answers under is that of the replicas
    # started on the new files, projector included; the old one's is the old pair's.
    assert model.canary["revision"] == replica_revision(_spec(model))
    assert model.canary["from_revision"] == old_revision != model.canary["revision"]
