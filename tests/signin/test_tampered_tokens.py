"""ID tokens signed with the real provider's own key (oidc-provider's, read through its discovery
document and JWKS) but tampered with are refused, each with its reason, and the one token that
passes every check is taken once."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.refusals import Refused
from tests.signin.real_provider import use_provider
from tests.support.oidc_provider import OidcProvider, oidc_provider_fixture  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.fixture
def provider(oidc_provider: OidcProvider, settings: Any, tmp_path: Path) -> Iterator[Any]:
    from signin.oidc import ProviderConfig, forget_providers, provider_for

    use_provider(oidc_provider, settings, tmp_path, redirect_uris=["http://127.0.0.1:9/cb"])
    config = ProviderConfig.from_settings()
    assert config is not None
    yield provider_for(config)
    forget_providers()


def _segment(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_tampered_id_tokens_are_refused_with_their_reason(
    oidc_provider: OidcProvider, provider: Any
) -> None:
    from signin.oidc import verify_id_token

    now = int(time.time())
    nonce = uuid.uuid4().hex
    good = {
        "iss": oidc_provider.issuer,
        "aud": provider.config.client_id,
        "sub": "ada",
        "iat": now,
        "exp": now + 300,
        "nonce": nonce,
        "groups": ["ml"],
    }
    mint = oidc_provider.mint_jwt
    header, _, signature = mint(good).split(".")
    cases = {
        "id_token_bad_signature": f"{header}.{_segment({**good, 'groups': ['llm-admins']})}.{signature}",
        "id_token_wrong_issuer": mint({**good, "iss": "http://127.0.0.1:9"}),
        "id_token_wrong_audience": mint({**good, "aud": "another-client"}),
        "id_token_expired": mint({**good, "iat": now - 7200, "exp": now - 3600}),
        "id_token_nonce_mismatch": mint({**good, "nonce": "another sign-in's"}),
        "id_token_algorithm_refused": f"{_segment({'alg': 'none', 'typ': 'JWT'})}.{_segment(good)}.",
    }
    for code, token in cases.items():
        with pytest.raises(Refused) as refused:
            verify_id_token(token, provider=provider, nonce=nonce)
        assert refused.value.code == code, (code, refused.value.message)
        assert refused.value.status == 400
    # The untampered one passes, once: replayed with its nonce it is refused.
    token = mint(good)
    assert verify_id_token(token, provider=provider, nonce=nonce).groups == ("ml",)
    with pytest.raises(Refused) as replayed:
        verify_id_token(token, provider=provider, nonce=nonce)
    assert replayed.value.code == "id_token_replayed"
