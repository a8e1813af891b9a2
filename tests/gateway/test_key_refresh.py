"""What a gateway process holds of the keys, and how it keeps up: a deactivated or deleted user's
keys stop within a second, and a refresh reads only the keys that changed (gateway.state.Keys)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from access.models import DeletedGatewayKey, GatewayKey, hash_key
from access.services import key_create, key_revoke
from core.actor import Actor
from gateway import relay
from gateway import state as gateway_state
from gateway.state import Keys
from tests.gateway.conftest import GatewayServer
from tests.support.gateway_state import current_state
from tests.support.waiting import stays, wait_for

pytestmark = pytest.mark.smoke

STOPS_WITHIN = 1.0


def create_key(user: Any, name: str = "app") -> str:
    return key_create(actor=Actor.for_user(user, "api"), name=name)[1]


def digest(secret: str) -> str:
    return hash_key(secret)


# -- a running gateway, refreshed by its own thread -----------------------------------------


@pytest.fixture
def front(transactional_db: Any) -> Iterator[GatewayServer]:
    running = GatewayServer(lifespan=True)
    yield running
    running.stop()


def status(front: GatewayServer, secret: str) -> int:
    response = requests.get(
        f"{front.url}/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10
    )
    return response.status_code


def answers_soon(front: GatewayServer, secret: str, wanted: int) -> None:
    """Waits for the key's answer to become `wanted`: within STOPS_WITHIN s, or the test fails."""
    wait_for(
        lambda: status(front, secret) == wanted,
        timeout=STOPS_WITHIN,
        what=f"the key's requests answered {wanted}",
    )


def test_a_deactivated_users_keys_stop_within_a_second(
    front: GatewayServer, users: dict[str, Any]
) -> None:
    alice = users["alice"]
    secret = create_key(alice)
    others = create_key(users["bob"])
    assert status(front, secret) == 200

    # As the admin or a shell does it: the row saved, no service involved.
    alice.is_active = False
    alice.save(update_fields=["is_active"])
    answers_soon(front, secret, 401)
    assert status(front, others) == 200  # only hers

    # Back again: her keys open again, as promptly.
    get_user_model().objects.filter(pk=alice.pk).update(is_active=True)
    answers_soon(front, secret, 200)


def test_a_deleted_users_keys_stop_within_a_second(
    front: GatewayServer, users: dict[str, Any]
) -> None:
    secret = create_key(users["carol"])
    assert status(front, secret) == 200
    users["carol"].delete()  # the keys go with her
    answers_soon(front, secret, 401)


def test_a_key_made_while_the_refresher_takes_its_first_look_is_waited_for(
    transactional_db: Any, users: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reads the state as it starts, then its refresher reads it again (its first look,
    slow on a loaded machine). A key made in between is not in what the worker read: a request
    for it waits for the refresher, not refused at once."""
    first_look = threading.Event()
    reload = gateway_state.GatewayState.reload

    def held(self: gateway_state.GatewayState) -> Any:
        if threading.current_thread().name == gateway_state.REFRESHER_THREAD:
            first_look.wait(timeout=10)
        return reload(self)

    waiting = threading.Event()  # the request waits for a look (relay.fresh_look)
    fresh_look = relay.fresh_look

    async def waits(gateway: Any, since: float) -> Any:
        waiting.set()
        return await fresh_look(gateway, since)

    monkeypatch.setattr(gateway_state.GatewayState, "reload", held)
    monkeypatch.setattr(relay, "fresh_look", waits)
    running = GatewayServer(lifespan=True)
    try:
        secret = create_key(users["alice"])
        answers: list[int] = []
        asking = threading.Thread(target=lambda: answers.append(status(running, secret)))
        asking.start()
        assert waiting.wait(10), "the request for the new key did not wait for a look"
        # Time is what is tested: it goes on waiting (a refusal would come at once).
        stays(lambda: answers == [], seconds=0.3, what="the request waiting for the first look")
        first_look.set()
        asking.join(timeout=15)
        assert answers == [200]
    finally:
        first_look.set()
        running.stop()


def test_a_revoked_key_stops_within_a_second(front: GatewayServer, users: dict[str, Any]) -> None:
    secret = create_key(users["alice"])
    assert status(front, secret) == 200
    key_revoke(
        actor=Actor.for_user(users["alice"], "api"),
        key_id=GatewayKey.objects.get(key_hash=digest(secret)).pk,
    )
    answers_soon(front, secret, 401)


# -- the key table itself ---------------------------------------------------------------------


def test_the_snapshot_holds_only_keys_of_active_users(users: dict[str, Any]) -> None:
    alice, bob = create_key(users["alice"]), create_key(users["bob"])
    users["bob"].is_active = False
    users["bob"].save()
    keys = Keys.read()
    assert keys[digest(alice)].active
    assert digest(bob) not in keys
    assert len(keys) == 1


def test_a_row_whose_hash_is_not_a_digest_is_skipped_not_an_outage(
    users: dict[str, Any], caplog: Any
) -> None:
    """One bad row (written by hand, or by an old import) opens nothing and stops nothing: the
    other keys are read, first time and after."""
    alice = create_key(users["alice"])
    GatewayKey.objects.create(
        owner=users["bob"], name="by hand", key_hash="alice".ljust(64, "0"), prefix="llmgw-x"
    )
    keys = Keys.read()
    assert keys[digest(alice)].active and len(keys) == 1
    DeletedGatewayKey.objects.create(key_hash="not hex", deleted_at=timezone.now())
    later = create_key(users["alice"], "later")
    keys.refresh()
    assert keys[digest(later)].active and keys[digest(alice)].active
    assert "not a hex digest" in caplog.text


def test_a_key_is_read_with_its_owner_whatever_its_id(users: dict[str, Any]) -> None:
    """The fair queue shares slots between people: each key carries its owner's id, packed
    beside the key's own (gateway.state.pack_key), with limits or without."""
    plain = create_key(users["alice"])
    limited = create_key(users["bob"])
    GatewayKey.objects.filter(key_hash=digest(limited)).update(id=2**62 + 5, rpm=10)
    keys = Keys.read()
    assert (keys[digest(plain)].owner_id, keys[digest(plain)].limits) == (users["alice"].id, None)
    far = keys[digest(limited)]
    assert (far.id, far.owner_id, far.active) == (2**62 + 5, users["bob"].id, True)
    assert far.limits is not None and far.limits.rpm == 10


def test_a_refresh_reads_only_the_keys_that_changed(
    users: dict[str, Any], monkeypatch: Any
) -> None:
    # No margin: the rows read are exactly those changed since the last read's horizon.
    monkeypatch.setattr(gateway_state, "KEY_MARGIN", timedelta(0))
    secrets = [create_key(users["alice"], f"app {n}") for n in range(40)]
    first = current_state().reload()
    assert len(first.keys) == 40 and first.keys.last_rows == 40

    key_revoke(
        actor=Actor.for_user(users["alice"], "api"),
        key_id=GatewayKey.objects.get(key_hash=digest(secrets[7])).pk,
    )
    second = current_state().reload()
    # The same table, changed in place: a change does not copy every key.
    assert second.keys is first.keys
    assert not second.keys[digest(secrets[7])].active
    assert second.keys[digest(secrets[8])].active
    # The revoked key, and at most the last ones added in the same instant as the horizon.
    assert second.keys.last_rows <= 3

    fresh = create_key(users["bob"])
    third = current_state().reload()
    assert third.keys[digest(fresh)].active and third.keys.last_rows <= 3
    assert third.keys.full_reads == 1


def test_deleted_keys_and_old_hashes_stop_opening(users: dict[str, Any]) -> None:
    alice, bob = create_key(users["alice"]), create_key(users["bob"])
    keys = Keys.read()
    users["bob"].delete()
    key = GatewayKey.objects.get(key_hash=digest(alice))
    key.key_hash = digest("llmgw-a-new-secret")
    key.save()
    keys.refresh()
    assert digest(bob) not in keys
    assert digest(alice) not in keys
    assert keys[digest("llmgw-a-new-secret")].id == key.pk
    assert set(DeletedGatewayKey.objects.values_list("key_hash", flat=True)) == {
        digest(bob),
        digest(alice),
    }


def test_deleted_hashes_are_forgotten_after_a_day_and_a_process_that_long_away_reads_all(
    users: dict[str, Any],
) -> None:
    secret = create_key(users["alice"])
    now = timezone.now()
    DeletedGatewayKey.objects.create(key_hash="a" * 64, deleted_at=now - timedelta(days=2))
    DeletedGatewayKey.objects.create(key_hash="b" * 64, deleted_at=now - timedelta(hours=2))
    keys = Keys.read()
    assert set(DeletedGatewayKey.objects.values_list("key_hash", flat=True)) == {"b" * 64}

    keys.read_at = time.monotonic() - timedelta(days=1).total_seconds()
    keys.refresh()
    assert keys.full_reads == 2 and digest(secret) in keys


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="SQLite writes one transaction at a time"
)
@pytest.mark.django_db(transaction=True)
def test_a_change_committed_after_a_later_one_is_not_missed(
    users: dict[str, Any], monkeypatch: Any
) -> None:
    """A key revoked in a transaction that commits after others that began later is still read:
    the horizon waits for the oldest open transaction that wrote (gateway.state.key_horizon)."""
    import psycopg

    monkeypatch.setattr(gateway_state, "KEY_MARGIN", timedelta(0))
    slow, quick = create_key(users["alice"], "slow"), create_key(users["alice"], "quick")
    keys = Keys.read()

    def database_clock() -> Any:
        with connection.cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            return cursor.fetchone()[0]

    params = connection.get_connection_params()
    for name in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(name, None)
    with psycopg.connect(**params) as other:
        other.execute(
            "UPDATE gateway_gatewaykey SET revoked_at = now() WHERE key_hash = %s", [digest(slow)]
        )
        # The quick key's change is stamped (by the database's clock) after the slow one's.
        (slow_stamp,) = other.execute(
            "SELECT changed_at FROM gateway_gatewaykey WHERE key_hash = %s", [digest(slow)]
        ).fetchone()
        wait_for(
            lambda: database_clock() > slow_stamp,
            what="the database's clock past the slow key's change",
        )
        GatewayKey.objects.filter(key_hash=digest(quick)).update(revoked_at=timezone.now())
        keys.refresh()
        assert not keys[digest(quick)].active
        assert keys[digest(slow)].active  # not committed yet
        other.commit()
    keys.refresh()
    assert not keys[digest(slow)].active
