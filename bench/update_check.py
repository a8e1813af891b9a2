"""The update check over 1,000 served models in 200 repositories against a local registry (olah):
registry requests made (must equal the repository count when nothing moved, and stay bounded by
twice that when every branch moved) and wall time.

Run: make bench (or .venv/bin/python bench/update_check.py [--repos 200 --models 1000])
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    from _django import setup  # type: ignore[import-not-found]

    setup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repos", type=int, default=200)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument(
        "--moved",
        type=int,
        default=20,
        help="repositories that get a new commit for the second check",
    )
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from catalog.config import current_config
    from catalog.models import Model
    from registry.hub import Registry
    from registry.updates import check_updates
    from tests.support.registry import LocalRegistry

    folder = Path(tempfile.mkdtemp(prefix="llmgw-bench-registry-"))
    per_repo = max(1, args.models // args.repos)
    registry = LocalRegistry(folder)
    started = time.perf_counter()
    commits = {}
    for r in range(args.repos):
        files = {f"model-q{q}.gguf": os.urandom(256) for q in range(per_repo)}
        commits[r] = registry.commit(f"bench/repo-{r:03d}", files)
    print(
        f"update_check: built {args.repos} git-lfs repositories with {per_repo} files each "
        f"in {time.perf_counter() - started:.1f}s"
    )
    with registry:
        api = Registry(endpoint=registry.endpoint)
        models = []
        for r in range(args.repos):
            repo = f"bench/repo-{r:03d}"
            files = {f.path: f for f in api.files(repo, commits[r])}
            for q in range(per_repo):
                path = f"model-q{q}.gguf"
                models.append(
                    Model(
                        name=f"m-{r:03d}-{q}",
                        source=f"http://127.0.0.1:8000/mirror/{repo}/{commits[r]}/{path}",
                        profiles=[
                            {
                                "name": "cpu",
                                "memory_gb": 1,
                                "cores": 1,
                                "gpus": 0,
                                "gpu_memory_gb": 0,
                            }
                        ],
                        origin={
                            "repo": repo,
                            "branch": "main",
                            "commit": commits[r],
                            "files": [
                                {
                                    "path": path,
                                    "sha256": files[path].sha256,
                                    "size": files[path].size,
                                }
                            ],
                        },
                    )
                )
        Model.objects.bulk_create(models)
        current_config.cache_clear()
        print(
            f"{'check':<34} {'models':>7} {'repos':>6} {'requests':>9} {'updates':>8} {'wall':>8}"
        )

        def run(label: str) -> None:
            checker = Registry(endpoint=registry.endpoint)
            start = time.perf_counter()
            report = check_updates(registry=checker)
            wall = time.perf_counter() - start
            print(
                f"{label:<34} {len(models):>7} {report.repositories:>6} {report.requests:>9} "
                f"{len(report.updates):>8} {wall:>7.2f}s"
            )

        run("nothing moved")
        for r in range(args.moved):
            registry.commit(
                f"bench/repo-{r:03d}", {"model-q0.gguf": os.urandom(256)}, message="new weights"
            )
        for r in range(args.moved, 2 * args.moved):
            registry.commit(f"bench/repo-{r:03d}", {"README.md": b"docs only\n"}, message="docs")
        run(f"{args.moved} new weights, {args.moved} docs-only")
        run("again (heads already seen)")


if __name__ == "__main__":
    main()
