"""The node agent serves a model with a vision projector: it fetches the projector beside the
weights, verifies its sha256, starts the engine with --mmproj, and the replica answers an
image; a projector whose bytes do not match fails the replica before any engine starts."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw import engine
from llmgw.node.spec import AnswerError, ReplicaSpec
from llmgw.tinygguf import write_tiny_mmproj, write_tiny_model
from tests.llmgw.node import test_agent
from tests.llmgw.node.test_agent import Agents, Mirror, replica_spec, settled
from tests.llmgw.test_engine_mmproj import _image_chat
from tests.support.fake_control_plane import FakeControlPlane
from tests.support.http_files import serve_directory

# The agent tests' own fixtures: a fake control plane, and agents stopped by their pids.
plane = test_agent.plane
agents = test_agent.agents


def test_the_answer_carries_the_projector_both_ways() -> None:
    data = {
        "id": str(uuid.uuid4()),
        "model": "vision",
        "source": "http://m/c1/w.gguf",
        "mmproj": {"source": "http://m/c1/mmproj.gguf", "sha256": "A" * 64},
    }
    spec = ReplicaSpec.from_json(data)
    assert spec.mmproj is not None
    assert (spec.mmproj.source, spec.mmproj.sha256) == ("http://m/c1/mmproj.gguf", "a" * 64)
    assert spec.to_json()["mmproj"] == {"source": "http://m/c1/mmproj.gguf", "sha256": "a" * 64}
    assert ReplicaSpec.from_json(spec.to_json()) == spec
    text = ReplicaSpec.from_json({**data, "mmproj": None})
    assert text.mmproj is None and "mmproj" not in text.to_json()


@pytest.mark.parametrize(
    ("mmproj", "why"),
    [
        ("http://m/mmproj.gguf", "mmproj is str, not an object"),
        ({"sha256": None}, "mmproj: source is None, not a non-empty string"),
        ({"source": "http://m/p.gguf", "sha256": "nope"}, "'nope' is not a sha256"),
    ],
)
def test_a_malformed_projector_refuses_the_answer(mmproj: object, why: str) -> None:
    data = {"id": "r1", "model": "vision", "source": "http://m/w.gguf", "mmproj": mmproj}
    with pytest.raises(AnswerError, match=why):
        ReplicaSpec.from_json(data)


@pytest.fixture
def vision_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vision-mirror")
    write_tiny_model(folder / "model.gguf", seed=1)
    write_tiny_mmproj(folder / "mmproj.gguf", seed=1)
    return folder


@pytest.fixture
def vision_mirror(vision_files: Path) -> Iterator[Mirror]:
    with serve_directory(vision_files) as (url, stats):
        yield Mirror(url, stats, vision_files)


@pytest.mark.engine
@pytest.mark.skipif(engine.find_engine() is None, reason="llama-server is not built")
def test_it_starts_the_engine_with_the_projector_and_answers_an_image(
    plane: FakeControlPlane,
    agents: Agents,
    vision_mirror: Mirror,
) -> None:
    spec = replica_spec(
        vision_mirror,
        mmproj={
            "source": vision_mirror.source("mmproj.gguf"),
            "sha256": vision_mirror.sha("mmproj.gguf"),
        },
    )
    agent = agents.start_wanting(spec)
    ready = settled(plane, spec, "ready")
    agents.engine_pid(agent, spec["id"])
    command = agent.state(spec["id"])["command"]
    projector = Path(command[command.index("--mmproj") + 1])
    assert projector.read_bytes() == (vision_mirror.files / "mmproj.gguf").read_bytes()
    answer = _image_chat(f"http://127.0.0.1:{ready['port']}")
    assert answer.status_code == 200, answer.text


@pytest.mark.engine
@pytest.mark.skipif(engine.find_engine() is None, reason="llama-server is not built")
def test_a_projector_with_the_wrong_sha256_fails_the_replica(
    plane: FakeControlPlane,
    agents: Agents,
    vision_mirror: Mirror,
) -> None:
    spec = replica_spec(
        vision_mirror,
        mmproj={"source": vision_mirror.source("mmproj.gguf"), "sha256": "0" * 64},
    )
    agent = agents.start_wanting(spec)
    failed = settled(plane, spec, "failed")
    source = vision_mirror.source("mmproj.gguf")
    assert f"the file at {source} (vision projector) has sha256 " in failed["message"]
    assert agent.state(spec["id"]).get("pid") is None  # no engine was started
