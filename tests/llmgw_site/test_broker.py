"""The embedded broker delivers every message whole, even while the worker reads as it is written."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from kombu import Connection, Queue

import llmgw_site.broker  # noqa: F401  (registers the transport's alias)

pytestmark = pytest.mark.smoke

MESSAGES = 200
BODY = "x" * 200_000  # large enough that a write takes a while
tasks = Queue("tasks")


def connection(folder: Path) -> Connection:
    queue = folder / "queue"
    for sub in ("queue", "processed", "control"):
        (folder / sub).mkdir(exist_ok=True)
    return Connection(
        "llmgwfs://",
        transport_options={
            "data_folder_in": str(queue),
            "data_folder_out": str(queue),
            "processed_folder": str(folder / "processed"),
            "store_processed": False,
            "control_folder": str(folder / "control"),
        },
    )


def test_a_reader_never_sees_a_message_half_written(tmp_path: Path) -> None:
    def produce() -> None:
        with connection(tmp_path) as conn:
            producer = conn.Producer()
            for index in range(MESSAGES):
                producer.publish(
                    {"index": index, "body": BODY}, routing_key="tasks", declare=[tasks]
                )

    writer = threading.Thread(target=produce)
    writer.start()
    seen = []
    with connection(tmp_path) as conn:
        queue = conn.SimpleQueue(tasks)
        while len(seen) < MESSAGES:
            message = queue.get(timeout=30)
            assert message.payload["body"] == BODY
            seen.append(message.payload["index"])
            message.ack()
        queue.close()
    writer.join(timeout=30)
    assert sorted(seen) == list(range(MESSAGES))
    assert not [p.name for p in (tmp_path / "queue").iterdir()]  # nothing left, not even partials


def test_the_settings_use_it_when_no_redis_is_named() -> None:
    from django.conf import settings

    if settings.REDIS_URL:
        pytest.skip("REDIS_URL is set: the broker is Redis")
    assert settings.CELERY_BROKER_URL == "llmgwfs://"
