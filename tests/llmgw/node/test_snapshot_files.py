"""A vLLM replica's files on the node (llmgw/node/replica.py): the snapshot's files and a PEFT
adapter's fetched into the blob cache, verified, and linked into the folders vLLM is given under
their repository paths, and kept from eviction while the replica needs them. The files come over
HTTP from a local folder; the agent is a stand-in of the few things a replica asks of it."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.node.agent import Agent
from llmgw.node.cache import BlobCache, FetchFailed
from llmgw.node.config import NodeConfig
from llmgw.node.replica import Replica
from llmgw.node.spec import ReplicaSpec
from tests.support.http_files import serve_directory
from tests.support.tiny_hf import make_tiny_llama, make_tiny_lora


class StandInAgent:
    """What a replica asks of its agent while it fetches and lays out its files."""

    def __init__(self, root: Path) -> None:
        self.config = NodeConfig(server="http://127.0.0.1:1", token="t", memory_gb=1, cores=1)
        self.cache = BlobCache(root / "cache", credentials=lambda url: {})
        self.cache.prepare()
        self.replicas_dir = root / "replicas"
        self.wake = threading.Event()
        self.exiting = threading.Event()
        self.engine_backends = ["CPU"]
        # What the agent's needed_blobs reads.
        self.lock = threading.Lock()
        self.replicas: dict[str, Replica] = {}
        self.stopping: dict[str, Replica] = {}
        self.kept: list[tuple[str, str | None]] = []

    def allocate_port(self, replica: Replica) -> int | None:
        return None

    def executable_of(self, name: str) -> str | None:
        return None

    def evict(self) -> None:
        return None


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    repo = tmp_path / "repo"
    make_tiny_llama(repo / "snap", seed=3, shards=2)
    make_tiny_lora(repo / "lora", rank=4)
    with serve_directory(repo) as (url, _):
        yield url, repo


def order(url: str, repo: Path, **fields: Any) -> dict[str, Any]:
    paths = sorted(p.name for p in (repo / "snap").iterdir() if p.name != "config.json")
    return {
        "id": "r1",
        "model": "tiny",
        "engine": "vllm",
        "source": f"{url}/snap/config.json",
        "sha256": sha(repo / "snap" / "config.json"),
        "files": [
            {"path": p, "source": f"{url}/snap/{p}", "sha256": sha(repo / "snap" / p)}
            for p in paths
        ],
        "adapters": [{"name": "sql", "source": f"{url}/lora/adapter_config.json", "scale": 1}],
        **fields,
    }


def test_the_snapshot_and_the_adapter_are_laid_out_as_vllm_loads_them(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    url, repo = served
    agent = StandInAgent(tmp_path / "agent")
    replica = Replica(agent, ReplicaSpec.from_json(order(url, repo)))  # type: ignore[arg-type]
    replica.folder.mkdir(parents=True)

    weights, adapters = replica._fetch_all()
    folder = replica._snapshot(weights, replica._fetch_files())

    for original in (repo / "snap").iterdir():
        laid = folder / original.name
        assert laid.is_symlink() and laid.read_bytes() == original.read_bytes(), original.name
        assert laid.resolve().parent == agent.cache.blobs  # the verified blob, not a copy
    [(adapter, adapter_folder)] = adapters
    assert adapter.name == "sql" and adapter_folder == replica.folder / "adapters" / "0"
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (adapter_folder / name).read_bytes() == (repo / "lora" / name).read_bytes()
    # Every blob it uses is kept from eviction, the adapter's weights (named by no sha256) too.
    agent.replicas[replica.spec.id] = replica
    needed = Agent.needed_blobs(agent)  # type: ignore[arg-type]
    assert needed == {p.resolve().name for p in folder.iterdir()} | {
        p.resolve().name for p in adapter_folder.iterdir()
    }


def test_a_snapshot_file_that_is_not_what_the_control_plane_said_is_not_served(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    url, repo = served
    wrong = order(url, repo)
    wrong["files"][0]["sha256"] = "0" * 64
    replica = Replica(StandInAgent(tmp_path / "agent"), ReplicaSpec.from_json(wrong))  # type: ignore[arg-type]
    replica.folder.mkdir(parents=True)
    with pytest.raises(FetchFailed):
        replica._fetch_files()
