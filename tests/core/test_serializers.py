"""core.serializers.FieldsOncePerThread: an input's fields built once per thread, and no
validation's outcome leaking into the next."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from fleet.api import HeartbeatInput

GOOD = {
    "capacity": {"memory_gb": 8, "cores": 4},
    "replicas": [{"id": str(uuid.uuid4()), "state": "ready", "port": 41000}],
}
BAD = {
    "capacity": {"memory_gb": -1, "cores": "four"},
    "devices": [
        {"index": 0, "memory_total_mb": 1, "memory_used_mb": 0},
        {"index": 0, "memory_total_mb": 1, "memory_used_mb": 0},
    ],
    "replicas": [{"id": "not-a-uuid", "state": "dreaming"}],
}


def check(data: dict[str, Any]) -> tuple[bool, Any, Any]:
    serializer = HeartbeatInput(data=data)
    valid = serializer.is_valid()
    return valid, serializer.errors, serializer.validated_data if valid else None


def test_the_fields_are_built_once_a_thread_and_not_shared_between_threads() -> None:
    assert HeartbeatInput().fields is HeartbeatInput().fields
    theirs: list[Any] = []
    other = threading.Thread(target=lambda: theirs.append(HeartbeatInput().fields))
    other.start()
    other.join()
    assert theirs[0] is not HeartbeatInput().fields
    # Bound to a blank instance of their own, not to the first request's.
    first = HeartbeatInput(data=GOOD)
    assert first.fields["capacity"].parent is not first


def test_a_refused_report_leaves_nothing_behind_for_the_next() -> None:
    for _ in range(3):
        valid, errors, _ = check(BAD)
        assert not valid
        assert set(errors) == {"capacity", "devices", "replicas"}
        assert set(errors["capacity"]) == {"memory_gb", "cores"}
        assert errors["replicas"][0].keys() == {"id", "state"}
        valid, errors, data = check(GOOD)
        assert valid, errors
        assert errors == {}
        assert data["capacity"] == {"memory_gb": 8.0, "cores": 4.0, "gpus": 0, "gpu_memory_gb": 0}
        assert data["replicas"][0]["state"] == "ready" and data["devices"] == []


def test_threads_validating_at_once_each_get_their_own_answer() -> None:
    wrong: list[str] = []

    def run(data: dict[str, Any], expect: bool) -> None:
        for _ in range(200):
            valid, errors, _ = check(data)
            if valid is not expect:
                wrong.append(f"{valid} {errors}")

    threads = [threading.Thread(target=run, args=(d, d is GOOD)) for d in (GOOD, BAD) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
