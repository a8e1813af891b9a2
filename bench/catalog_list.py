"""GET /api/v1/models at 100, 1,000 and 10,000 models: SQL queries per request and median latency,
beside a bare Django view serving the same rows (the baseline ratio).

Run: make bench (or .venv/bin/python bench/catalog_list.py [--sizes 100,1000])
"""

from __future__ import annotations

import argparse
import statistics
import time

if __name__ == "__main__":
    from _django import setup  # type: ignore[import-not-found]

    setup(urlconf="bench.catalog_list")

from django.http import HttpRequest, JsonResponse
from django.urls import include, path


def bare_models(request: HttpRequest) -> JsonResponse:
    """The baseline: the same rows straight from the ORM, no DRF, no shaping."""
    from catalog.models import Model

    rows = list(
        Model.objects.values(
            "name",
            "source",
            "owner__username",
            "model_class",
            "min_replicas",
            "max_replicas",
            "idle_timeout",
            "fallbacks",
            "context_length",
            "profiles",
            "adapters",
            "declared",
        ).order_by("name")
    )
    return JsonResponse(rows, safe=False)


urlpatterns = [
    path("bare/models", bare_models),
    path("", include("llmgw_site.urls")),
]


def fill(count: int, owner: object) -> None:
    from catalog.models import Model

    existing = Model.objects.count()
    Model.objects.bulk_create(
        Model(
            name=f"model-{i:05d}",
            source=f"http://127.0.0.1:8000/mirror/acme/m{i}/abc/m{i}.gguf",
            owner=owner,
            min_replicas=i % 3,
            max_replicas=None if i % 2 else 2,
            profiles=[{"name": "cpu", "memory_gb": 2, "cores": 1, "gpus": 0, "gpu_memory_gb": 0}],
            adapters=[
                {"name": f"adapter-{i:05d}", "source": "http://127.0.0.1:8000/a.gguf", "scale": 1}
            ]
            if i % 10 == 0
            else [],
        )
        for i in range(existing, count)
    )


def measure(client: object, url: str, repeats: int) -> tuple[int, float, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    timings = []
    queries = 0
    size = 0
    for _ in range(repeats):
        with CaptureQueriesContext(connection) as captured:
            start = time.perf_counter()
            response = client.get(url)  # type: ignore[attr-defined]
            timings.append(time.perf_counter() - start)
        assert response.status_code == 200, response.status_code
        queries = len(captured.captured_queries)
        size = len(response.content)
    return queries, statistics.median(timings), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from django.contrib.auth import get_user_model
    from django.test import Client

    from accounts.services import token_create

    user = get_user_model().objects.create_user("bench", password="bench-password")
    _, token = token_create(user=user)
    client = Client(HTTP_AUTHORIZATION=f"Token {token}")
    print("catalog_list: GET /api/v1/models vs a bare Django view of the same rows")
    print(
        f"{'models':>7} {'api queries':>11} {'api median':>11} {'bare queries':>12} {'bare median':>12} {'ratio':>6} {'api bytes':>10}"
    )
    for size in [int(s) for s in args.sizes.split(",")]:
        fill(size, user)
        api_queries, api_median, api_bytes = measure(client, "/api/v1/models", args.repeats)
        bare_queries, bare_median, _ = measure(client, "/bare/models", args.repeats)
        print(
            f"{size:>7} {api_queries:>11} {api_median * 1000:>9.1f}ms {bare_queries:>12} "
            f"{bare_median * 1000:>10.1f}ms {api_median / bare_median:>6.2f} {api_bytes:>10}"
        )


if __name__ == "__main__":
    main()
