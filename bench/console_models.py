"""The console's Models page at 100, 1,000 and 10,000 models: SQL queries per render and median time.

The page shows one page of models (50) whatever the size of the catalog, so the
number of queries must not grow with it; the time grows only with what the
database does to count and filter. A third of the models have a ready replica.

Run: make bench (or .venv/bin/python bench/console_models.py [--sizes 100,1000])
"""

from __future__ import annotations

import argparse
import statistics
import time

if __name__ == "__main__":
    from _django import setup  # type: ignore[import-not-found]

    setup()

PAGES = {
    "first page": "/",
    "page 2, filtered by state": "/?state=ready&page=2",
    "search": "/?q=model-0",
}


def fill(count: int, owner: object, node: object) -> None:
    from catalog.models import Model
    from fleet.models import Replica

    existing = Model.objects.count()
    models = Model.objects.bulk_create(
        Model(
            name=f"model-{i:05d}",
            source=f"http://127.0.0.1:8000/mirror/acme/m{i}/abc/m{i}.gguf",
            owner=owner,
            min_replicas=1 if i % 3 == 0 else i % 3 - 1,
            max_replicas=None if i % 2 else 2,
            profiles=[{"name": "cpu", "memory_gb": 2, "cores": 1, "gpus": 0, "gpu_memory_gb": 0}],
        )
        for i in range(existing, count)
    )
    if not models or models[0].pk is None:  # a backend that does not return ids
        models = list(Model.objects.filter(name__gte=f"model-{existing:05d}"))
    Replica.objects.bulk_create(
        Replica(
            model=model,
            model_name=model.name,
            node=node,
            profile="cpu",
            memory_gb=2,
            cores=1,
            spec={},
            spec_key="bench",
            state=Replica.READY,
        )
        for model in models
        if int(model.name.rsplit("-", 1)[1]) % 3 == 0
    )


def measure(client: object, url: str, repeats: int) -> tuple[int, float]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    timings = []
    queries = 0
    for _ in range(repeats):
        with CaptureQueriesContext(connection) as captured:
            start = time.perf_counter()
            response = client.get(url)  # type: ignore[attr-defined]
            timings.append(time.perf_counter() - start)
        assert response.status_code == 200, response.status_code
        queries = len(captured.captured_queries)
    return queries, statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from django.contrib.auth import get_user_model
    from django.test import Client

    from fleet.models import Node

    user = get_user_model().objects.create_user("bench", password="bench-password")
    node = Node.objects.create(name="bench-node", token_hash="0" * 64, memory_gb=1e6, cores=1e6)
    client = Client()
    client.force_login(user)
    print("console_models: the console's Models page (50 models a page)")
    print(f"{'models':>7}  {'page':<26} {'queries':>7} {'median':>9}")
    for size in [int(s) for s in args.sizes.split(",")]:
        fill(size, user, node)
        for label, url in PAGES.items():
            queries, median = measure(client, url, args.repeats)
            print(f"{size:>7}  {label:<26} {queries:>7} {median * 1000:>7.1f}ms")


if __name__ == "__main__":
    main()
