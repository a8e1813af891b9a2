"""llmgw.bearer: one digest for every bearer secret, its column twins, and the rows stored
before it still opening what they opened.

API tokens (accounts), gateway keys (gateway) and node tokens (fleet) each once hashed in a
copy of their own; the copies agreed by luck of encoding. Here each door's stored hash is held
to bearer.digest, each kind's shown characters and digest to the columns that keep them, and the
prefixes the gateway and fleet services still write to the kinds declared here.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from access import services as gateway_services
from access.models import GatewayKey, hash_key
from accounts.models import ApiToken
from accounts.services import token_create, token_user
from fleet.models import Node, hash_token
from fleet.services import authenticate_node
from llmgw.bearer import API_TOKEN, DIGEST_LENGTH, GATEWAY_KEY, NODE_TOKEN, BearerKind, digest

KINDS = [API_TOKEN, GATEWAY_KEY, NODE_TOKEN]


def test_the_digest_is_the_sha256_every_stored_hash_was_made_with() -> None:
    # Pinned: changing it would lock every token, key and node out.
    assert digest("llmgw_0123456789abcdef") == (
        "741eff73c6fc13411ce70f079814fa8ae8659dacc7fd2100c2ab2f5471f6a432"
    )
    for secret in ("llmgw-abc", "llmgw-node-xyz", "ünïcode"):
        assert digest(secret) == hashlib.sha256(secret.encode()).hexdigest()


def test_a_secret_that_is_not_utf8_hashes_instead_of_raising() -> None:
    assert len(digest("llmgw_\udcff")) == DIGEST_LENGTH


def test_the_gateway_and_the_fleet_hash_by_it() -> None:
    for kind in KINDS:
        secret = kind.new()
        assert hash_key(secret) == hash_token(secret) == digest(secret)


@pytest.mark.parametrize(
    ("model", "shown", "hashed"),
    [
        (ApiToken, "prefix", "digest"),
        (GatewayKey, "prefix", "key_hash"),
        (Node, None, "token_hash"),
    ],
)
def test_what_a_kind_keeps_fits_its_columns(model: Any, shown: str | None, hashed: str) -> None:
    kind = {ApiToken: API_TOKEN, GatewayKey: GATEWAY_KEY, Node: NODE_TOKEN}[model]
    assert model._meta.get_field(hashed).max_length == DIGEST_LENGTH
    if shown is None:
        assert kind.shown == 0
    else:
        assert 0 < kind.shown <= model._meta.get_field(shown).max_length


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.what)
def test_a_new_secret_has_its_prefix_and_shows_less_than_a_third(kind: BearerKind) -> None:
    secret = kind.new()
    assert kind.is_one(secret) and len(secret) >= len(kind.prefix) + 43
    assert kind.shown_part(secret).startswith(kind.prefix[: kind.shown])
    assert len(kind.shown_part(secret)) < len(secret) // 3
    assert kind.new() != secret


def test_the_prefixes_the_services_write_are_the_kinds() -> None:
    # access.services and fleet.services still make their secrets themselves; these hold them
    # to llmgw.bearer until they ask GATEWAY_KEY.new() and NODE_TOKEN.new().
    assert GATEWAY_KEY.prefix == gateway_services.KEY_PREFIX
    assert GATEWAY_KEY.shown == gateway_services.SHOWN_CHARS


@pytest.mark.django_db
def test_a_node_token_has_its_prefix_and_opens_its_node(fleet_staff: Any) -> None:
    from fleet.services import node_add

    node, token = node_add(actor=fleet_staff, name="a")
    assert NODE_TOKEN.is_one(token)
    assert authenticate_node(token) == node
    assert Node.objects.get(pk=node.pk).token_hash == digest(token)


@pytest.mark.django_db
def test_an_api_token_is_stored_as_its_digest_and_shown_part(users: dict[str, Any]) -> None:
    token, secret = token_create(user=users["alice"])
    row = ApiToken.objects.get(pk=token.pk)
    assert API_TOKEN.is_one(secret)
    assert (row.prefix, row.digest) == (API_TOKEN.shown_part(secret), digest(secret))


@pytest.mark.django_db
def test_rows_stored_before_the_one_digest_still_open(users: dict[str, Any]) -> None:
    # Made the way accounts.services and fleet.models hashed before llmgw.bearer.
    secret = "llmgw_" + "ab" * 24
    ApiToken.objects.create(
        user=users["alice"], prefix=secret[:12], digest=hashlib.sha256(secret.encode()).hexdigest()
    )
    assert token_user(secret) == users["alice"]
    node_secret = "llmgw-node-old"
    node = Node.objects.create(
        name="old", token_hash=hashlib.sha256(node_secret.encode()).hexdigest()
    )
    assert authenticate_node(node_secret) == node


@pytest.fixture
def fleet_staff(users: dict[str, Any]) -> Any:
    from core.actor import Actor

    return Actor.for_user(users["staff"], "api")
