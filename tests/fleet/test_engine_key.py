"""fleet.specs.engine_key: the key a replica's engine is started with, derived from the secret."""

from __future__ import annotations

from typing import Any

from django.utils.crypto import salted_hmac

from fleet.specs import engine_key


def test_the_engine_key_is_djangos_salted_hmac_of_the_replica_id(settings: Any) -> None:
    for replica_id in ("0b7f9f6e-0000-4000-8000-000000000001", "x"):
        expected = salted_hmac("llmgw.engine-key", replica_id, algorithm="sha256").hexdigest()
        assert engine_key(replica_id) == expected
    before = engine_key("x")
    settings.SECRET_KEY = "another-secret-of-this-installation"
    assert engine_key("x") != before  # the secret changed: every key changes
    assert engine_key("x") == salted_hmac("llmgw.engine-key", "x", algorithm="sha256").hexdigest()
