"""signin.people: the refresh token kept sealed, and what the provider says of someone now."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model

from signin.models import Identity
from signin.people import _seal, refresh_identity, refresh_token_of
from tests.signin.stub_provider import StubProvider

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def identity(provider: StubProvider) -> Identity:
    user = get_user_model().objects.create_user("dana")
    return Identity.objects.create(
        issuer=provider.issuer, subject="subject-1", user=user, refresh_token=_seal("rt-1")
    )


def test_the_refresh_token_is_kept_sealed(identity: Identity, settings: Any) -> None:
    assert "rt-1" not in identity.refresh_token
    assert refresh_token_of(identity) == "rt-1"
    # Under another secret key it cannot be read, which counts as none.
    settings.SECRET_KEY = "another secret key of more than fifty characters, for this test"
    assert refresh_token_of(identity) == ""


def test_it_asks_the_provider_with_the_refresh_token(
    provider: StubProvider, identity: Identity
) -> None:
    token = provider.sign(provider.claims(nonce=None, groups=["llm-admins"]))
    provider.answer_with(token, refresh_token="rt-2")
    claims = refresh_identity(identity)
    assert claims is not None
    assert claims.groups == ("llm-admins",)
    (sent,) = provider.token_requests
    assert sent["form"] == {"grant_type": "refresh_token", "refresh_token": "rt-1"}
    # The provider rotated it: the new one is kept.
    identity.refresh_from_db()
    assert refresh_token_of(identity) == "rt-2"


def test_a_refused_refresh_token_says_nothing_more_is_known(
    provider: StubProvider, identity: Identity
) -> None:
    provider.token_answer = lambda form: (400, {"error": "invalid_grant"})
    assert refresh_identity(identity) is None


def test_a_token_about_someone_else_is_not_taken(
    provider: StubProvider, identity: Identity
) -> None:
    provider.answer_with(provider.sign(provider.claims(nonce=None, sub="subject-2")))
    assert refresh_identity(identity) is None


def test_without_a_refresh_token_the_provider_is_not_asked(
    provider: StubProvider, identity: Identity
) -> None:
    identity.refresh_token = ""
    assert refresh_identity(identity) is None
    assert provider.hits["token"] == 0


def test_a_refresh_answered_without_an_id_token_says_nothing_of_the_person(
    provider: StubProvider, identity: Identity, settings: Any
) -> None:
    from signin.leavers import check_members
    from signin.oidc import ProviderUnavailable
    from signin.people import NO_ID_TOKEN

    provider.token_answer = lambda form: (200, {"access_token": "at", "token_type": "Bearer"})
    with pytest.raises(ProviderUnavailable) as unknown:
        refresh_identity(identity)
    assert unknown.value.code == NO_ID_TOKEN
    # The membership check counts them as not known, and nobody leaves for it.
    settings.LLMGW_OIDC_RECHECK_SECONDS = 0
    run = check_members()
    assert (run.unknown, run.left, run.stopped) == (1, [], "")
    identity.user.refresh_from_db()
    assert identity.user.is_active
