"""What keeping traffic figures costs: per request in the gateway, and the Model page with a week.

1. Per request: the gateway adds each answer to its in-memory book (TrafficBook.record) and its
   state thread writes the book every 5 s (TrafficBook.flush, one upsert per model-minute and
   key-day). Measured here on the real book and database, in alternating rounds: the time of
   record() per call, and the time of each flush divided by the requests it wrote, at a steady
   load spread over MODELS models and KEYS keys. Target (issue 13): < 0.1 ms per request.
2. The Model page with 0, 1 and 7 days of figures (two writers a minute for a day, then hours):
   SQL queries and median render time, for each window. Target: constant queries.

Run: make bench, or .venv/bin/python bench/traffic.py [--requests N]
"""

from __future__ import annotations

import argparse
import statistics
import time

if __name__ == "__main__":
    from _django import setup  # type: ignore[import-not-found]

    setup()

MODELS = 20
KEYS = 50
TARGET_MS = 0.1


def per_request(requests: int, rounds: int) -> tuple[float, float]:
    """(record µs per request, flush µs per request), medians over rounds."""
    from django.contrib.auth import get_user_model

    from access.models import GatewayKey
    from access.traffic import TrafficBook

    owner = get_user_model().objects.create_user("bench-keys")
    keys = [
        GatewayKey.objects.create(
            name=f"k{i}", owner=owner, prefix=f"p{i}", key_hash=f"{i:064d}"
        ).pk
        for i in range(KEYS)
    ]
    records, flushes = [], []
    start = time.time()
    for round_ in range(rounds):
        book = TrafficBook(f"bench-{round_}")
        # Five seconds' worth of requests (what one flush writes), at `requests` per second.
        batch = requests * 5
        began = time.perf_counter()
        for i in range(batch):
            book.record(
                model=f"model-{i % MODELS}",
                key_id=None if i % 7 == 0 else keys[i % KEYS],
                status=200 if i % 50 else 503,
                seconds=0.05 + (i % 13) * 0.01,
                prompt=20,
                completion=32,
                at=start + round_ * 5 + i / requests,
            )
        records.append((time.perf_counter() - began) / batch * 1e6)
        began = time.perf_counter()
        book.flush(now=start + round_ * 5 + 5)
        flushes.append((time.perf_counter() - began) / batch * 1e6)
    return statistics.median(records), statistics.median(flushes)


def fill_week(model: str) -> None:
    from datetime import UTC, datetime, timedelta

    from access.models import TrafficMinute
    from access.traffic import LATENCY_BOUNDS

    now = datetime.now(UTC).replace(second=0, microsecond=0)
    buckets = [3, 5, 2] + [0] * (len(LATENCY_BOUNDS) - 3)
    TrafficMinute.objects.bulk_create(
        [
            TrafficMinute(
                model=model,
                start=now - timedelta(hours=h),
                span=3600,
                requests=600,
                latency_buckets=buckets,
            )
            for h in range(24, 24 * 7)
        ]
        + [
            TrafficMinute(
                model=model,
                start=now - timedelta(minutes=m),
                writer=w,
                requests=10,
                latency_buckets=buckets,
            )
            for m in range(24 * 60)
            for w in ("a", "b")
        ],
        batch_size=2000,
    )


def model_page(rounds: int) -> list[tuple[str, str, int, float]]:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from access.models import TrafficMinute
    from catalog.definitions import clean_definition
    from catalog.services import model_add
    from core.actor import Actor
    from tests.factories import definition

    admin = get_user_model().objects.create_superuser("bench-admin", password="x")
    model_add(
        actor=Actor.for_user(admin, "api"),
        definition=clean_definition(definition("bench-chat")),
        source_check=False,
    )
    client = Client()
    client.force_login(admin)
    results = []
    for days, label in ((0, "bench-chat: none"), (7, "bench-chat: 7 days")):
        if days:
            fill_week("bench-chat")
        rows = TrafficMinute.objects.count()
        for window in ("hour", "day", "week"):
            url = f"/models/bench-chat/traffic?window={window}"
            client.get(url)  # warm
            times = []
            for _ in range(rounds):
                with CaptureQueriesContext(connection) as queries:
                    began = time.perf_counter()
                    client.get(url)
                    times.append((time.perf_counter() - began) * 1000)
            results.append(
                (f"{label} ({rows} rows)", window, len(queries), statistics.median(times))
            )
        with CaptureQueriesContext(connection) as queries:
            began = time.perf_counter()
            client.get("/models/bench-chat/")
            whole = (time.perf_counter() - began) * 1000
        results.append((f"{label} ({rows} rows)", "whole page", len(queries), whole))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per second")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    print("== traffic figures: cost per request (bench/traffic.py)")
    record_us, flush_us = per_request(args.requests, args.rounds)
    total_ms = (record_us + flush_us) / 1000
    print(
        f"  {args.requests} requests/s over {MODELS} models and {KEYS} keys, median of "
        f"{args.rounds} rounds of 5 s of requests:"
    )
    print(f"  record (on the request's path): {record_us:7.2f} µs per request")
    print(f"  flush (state thread, every 5 s): {flush_us:7.2f} µs per request")
    verdict = "met" if total_ms < TARGET_MS else "NOT met"
    print(f"  total: {total_ms:.4f} ms per request   target < {TARGET_MS} ms: {verdict}")

    print("\n== Model page with traffic figures: queries and median render time")
    results = model_page(args.rounds)
    for data, window, queries, ms in results:
        print(f"  {data:30s} {window:11s} {queries:3d} queries  {ms:7.1f} ms")
    by_window: dict[str, set[int]] = {}
    for _, window, queries, _ in results:
        by_window.setdefault(window, set()).add(queries)
    constant = all(len(q) == 1 for q in by_window.values())
    print(f"  target: constant queries with 7 days of data: {'met' if constant else 'NOT met'}")


if __name__ == "__main__":
    main()
