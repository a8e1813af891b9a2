"""The demo registry: a local Hugging Face-style repository the run command serves a model from.

`make run` keeps a git + git-lfs repository, DEMO_REPO, under var/demo-registry and serves
its GGUF file (a tiny generated model) through olah, following the `main` branch. Publishing
commits a new generated file (another seed, so another sha256), which the next update check
reports as an update of the served model:

    llmgw demo publish        # then: llmgw ctl model updates --check

Nothing here downloads anything: every weight file is generated. Imports no Django.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from .ctl.output import program
from .localhub import HubError, LocalHub, unavailable
from .tinygguf import write_tiny_model

DEMO_REPO = "llmgw-demo/tiny-chat"
DEMO_FILE = "tiny-chat.gguf"
DEMO_MODEL = "demo-tiny-chat"


def default_folder() -> Path:
    """var/demo-registry, beside the rest of the run command's state (LLMGW_VAR_DIR moves it)."""
    return Path(os.environ.get("LLMGW_VAR_DIR") or "var").resolve() / "demo-registry"


def hub(folder: Path | None = None, *, port: int | None = None) -> LocalHub:
    folder = folder or default_folder()
    folder.mkdir(parents=True, exist_ok=True)
    return LocalHub(folder, port=port)


def _commit_weights(registry: LocalHub, seed: int, message: str) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / DEMO_FILE
        write_tiny_model(path, seed=seed)
        return registry.commit(DEMO_REPO, {DEMO_FILE: path}, message=message)


def ensure_repo(registry: LocalHub) -> str:
    """The demo repository with its first weights; returns the head of main."""
    if registry.has(DEMO_REPO):
        return registry.head(DEMO_REPO)
    return _commit_weights(registry, seed=1, message="first weights (seed 1)")


def publish(registry: LocalHub) -> tuple[str, int]:
    """Commit new generated weights to the demo repository; returns (commit, seed)."""
    ensure_repo(registry)
    # Each commit adds one: README + first weights is commit 1, so the seeds run 2, 3, …
    seed = registry.commit_count(DEMO_REPO) + 1
    return _commit_weights(registry, seed=seed, message=f"new weights (seed {seed})"), seed


# -- the command line ---------------------------------------------------------------------


def add_parser(subparsers: Any) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="the demo registry that `make run` serves its demo model from",
        description=(
            "The run command keeps a local Hugging Face-style registry under var/demo-registry "
            f"holding {DEMO_REPO}, and serves {DEMO_MODEL} from it."
        ),
    )
    actions = demo.add_subparsers(dest="action", required=True, metavar="ACTION")
    publish_parser = actions.add_parser(
        "publish",
        help="commit new generated weights to the demo repository",
        description=(
            f"Commits a newly generated {DEMO_FILE} (another seed, so other bytes) to "
            f"{DEMO_REPO} on main. The registry serves it at once; the next update check "
            "(every mirror.update_check, or `llmgw ctl model updates --check`, or Check for updates "
            f"now on the model's page in the console) shows {DEMO_MODEL} with an update available."
        ),
    )
    publish_parser.add_argument(
        "--folder",
        type=Path,
        default=None,
        help="the demo registry's folder (default: var/demo-registry, or under LLMGW_VAR_DIR)",
    )


def run(args: argparse.Namespace) -> int:
    why = unavailable()
    if why is not None:
        print(f"llmgw demo: cannot publish: {why}.")
        return 1
    folder = args.folder or default_folder()
    if not (folder / "mirrors").exists():
        print(
            f"llmgw demo: there is no demo registry in {folder}. `make run` creates it on its "
            "first start (without --no-demo); or pass --folder."
        )
        return 1
    try:
        commit, seed = publish(hub(folder))
    except HubError as exc:
        print(f"llmgw demo: {exc}")
        return 1
    llmgw = program()
    print(
        f"Published new weights to {DEMO_REPO}: commit {commit[:7]} (seed {seed}).\n"
        f"See it: {llmgw} ctl model updates --check, or Check for updates now on {DEMO_MODEL}'s "
        f"page in the console; "
        f"then {llmgw} ctl model update {DEMO_MODEL} --wait, and {llmgw} ctl model rollback "
        f"{DEMO_MODEL} --wait."
    )
    return 0
