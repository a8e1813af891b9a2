"""signin.oidc: the provider's documents, read within bounds, and the ID token's checks, against
a real HTTP server on 127.0.0.1 (tests/signin/stub_provider.py) with keys made here."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from joserfc.jwk import ECKey, RSAKey

from core.refusals import Refused
from signin import oidc
from signin.oidc import ProviderConfig, provider_for, read_client_secret, verify_id_token
from tests.signin.stub_provider import CLIENT_ID, StubProvider, b64

pytestmark = [pytest.mark.django_db]


def verify(provider: StubProvider, token: str, nonce: str = "nonce-1") -> oidc.Claims:
    config = ProviderConfig.from_settings()
    assert config is not None
    return verify_id_token(token, provider=provider_for(config), nonce=nonce)


def refusal_of(provider: StubProvider, token: str, nonce: str = "nonce-1") -> Refused:
    with pytest.raises(Refused) as caught:
        verify(provider, token, nonce)
    return caught.value


def unsigned(header: dict[str, Any], claims: dict[str, Any], signature: bytes = b"") -> str:
    parts = [json.dumps(header).encode(), json.dumps(claims).encode()]
    return ".".join([*(b64(p) for p in parts), b64(signature)])


# -- the token -------------------------------------------------------------------------------


def test_it_takes_a_good_token_and_reads_the_person(provider: StubProvider) -> None:
    claims = verify(provider, provider.sign(provider.claims(groups=["llm-users", "ops"])))
    assert (claims.issuer, claims.subject) == (provider.issuer, "subject-1")
    assert (claims.preferred_username, claims.email) == ("dana", "dana@example.com")
    assert (claims.given_name, claims.family_name) == ("Dana", "Scully")
    assert claims.groups == ("llm-users", "ops")
    # Discovery and keys were read once, and are kept for the next token.
    verify(provider, provider.sign(provider.claims(nonce="nonce-2")), nonce="nonce-2")
    assert provider.hits == {"discovery": 1, "jwks": 1}


def test_it_refuses_a_signature_by_another_key_under_the_providers_kid(
    provider: StubProvider,
) -> None:
    impostor = RSAKey.generate_key(2048, parameters={"kid": "key-1"})
    refusal = refusal_of(provider, provider.sign(provider.claims(), key=impostor))
    assert refusal.code == "id_token_bad_signature"
    assert refusal.status == 400
    assert refusal.message == (
        "The sign-in was refused: the ID token's signature does not match. Nothing was "
        "changed; start again from the login page."
    )


def test_it_refuses_a_token_whose_payload_was_changed(provider: StubProvider) -> None:
    header, _, signature = provider.sign(provider.claims()).split(".")
    forged = b64(json.dumps(provider.claims(sub="someone-else")).encode())
    assert refusal_of(provider, f"{header}.{forged}.{signature}").code == "id_token_bad_signature"


# A time claim given as FROM_NOW + seconds is that many seconds from when the test runs.
FROM_NOW = 10**12


@pytest.mark.parametrize(
    ("changes", "code", "words"),
    [
        ({"iss": "http://127.0.0.1:1"}, "id_token_wrong_issuer", "was issued by"),
        ({"aud": "another-client"}, "id_token_wrong_audience", "meant for another client"),
        ({"aud": [CLIENT_ID, "another"]}, "id_token_wrong_audience", "another client (azp)"),
        ({"azp": "another-client"}, "id_token_wrong_audience", "another client (azp)"),
        # Times as seconds from when the test runs (FROM_NOW), not from when it was collected:
        # a test that runs late in a long suite would find a "future" already past.
        ({"exp": FROM_NOW - 120}, "id_token_expired", "has expired"),
        ({"iat": FROM_NOW + 600}, "id_token_malformed", "issued in the future"),
        ({"nonce": "nonce-of-another-sign-in"}, "id_token_nonce_mismatch", "nonce is not"),
        ({"nonce": None}, "id_token_nonce_mismatch", "nonce is not"),
        ({"sub": ""}, "id_token_malformed", "names no subject"),
        ({"groups": "llm-users,ops"}, None, None),
        ({"groups": {"a": 1}}, "groups_claim_invalid", "not a list of group names"),
    ],
)
def test_it_checks_each_claim(
    provider: StubProvider, changes: dict[str, Any], code: str | None, words: str | None
) -> None:
    now = int(time.time())
    changes = {
        k: now + (v - FROM_NOW) if isinstance(v, int) and v > FROM_NOW // 2 else v
        for k, v in changes.items()
    }
    token = provider.sign(provider.claims(**changes))
    if code is None:
        assert verify(provider, token).groups == ("llm-users,ops",)
        return
    refusal = refusal_of(provider, token)
    assert (refusal.code, refusal.status) == (code, 400)
    assert words in refusal.message


def test_it_takes_a_token_with_both_audiences_when_it_was_given_to_llmgw(
    provider: StubProvider,
) -> None:
    token = provider.sign(provider.claims(aud=[CLIENT_ID, "another"], azp=CLIENT_ID))
    assert verify(provider, token).subject == "subject-1"


def test_a_token_is_taken_once(provider: StubProvider) -> None:
    token = provider.sign(provider.claims())
    verify(provider, token)
    refusal = refusal_of(provider, token)
    assert refusal.code == "id_token_replayed"
    assert "already used for a sign-in" in refusal.message


def test_it_refuses_alg_none(provider: StubProvider) -> None:
    token = unsigned({"alg": "none", "kid": "key-1"}, provider.claims())
    refusal = refusal_of(provider, token)
    assert refusal.code == "id_token_algorithm_refused"
    assert "signed with 'none', not one of RS256" in refusal.message


@pytest.mark.parametrize("advertised", [["RS256"], ["RS256", "HS256"]])
def test_it_refuses_hs256_signed_with_the_providers_public_key(
    provider: StubProvider, advertised: list[str]
) -> None:
    # The classic confusion: a verifier that takes the token's alg reads the RSA public key
    # (PEM, as found in the JWKS) as an HMAC secret, which anyone has.
    provider.discovery_extra = {"id_token_signing_alg_values_supported": advertised}
    public_pem = provider.key.as_pem(private=False)
    header = {"alg": "HS256", "kid": "key-1", "typ": "JWT"}
    signing_input = ".".join(
        b64(json.dumps(part).encode()) for part in (header, provider.claims())
    ).encode()
    signature = hmac.new(public_pem, signing_input, hashlib.sha256).digest()
    token = f"{signing_input.decode()}.{b64(signature)}"
    refusal = refusal_of(provider, token)
    assert refusal.code == "id_token_algorithm_refused"


def test_it_takes_only_algorithms_the_provider_advertises(provider: StubProvider) -> None:
    provider.discovery_extra = {"id_token_signing_alg_values_supported": ["ES256"]}
    refusal = refusal_of(provider, provider.sign(provider.claims()))
    assert refusal.code == "id_token_algorithm_refused"
    assert "not one of ES256" in refusal.message


def test_it_refuses_an_algorithm_the_key_is_not_for(provider: StubProvider) -> None:
    # The provider advertises ES256 and RS256; a token says ES256 under the RSA key's kid.
    provider.discovery_extra = {"id_token_signing_alg_values_supported": ["RS256", "ES256"]}
    other = ECKey.generate_key("P-256", parameters={"kid": "key-1"})
    refusal = refusal_of(provider, provider.sign(provider.claims(), key=other, alg="ES256"))
    assert refusal.code == "id_token_unknown_key"


def test_an_unknown_kid_reads_the_keys_once_more_then_is_refused(
    provider: StubProvider,
) -> None:
    verify(provider, provider.sign(provider.claims(nonce="n-0")), nonce="n-0")
    assert provider.hits["jwks"] == 1
    stranger = RSAKey.generate_key(2048, parameters={"kid": "key-x"})
    # Older than the refresh interval: one more read of the JWKS, then the refusal.
    provider_for(ProviderConfig.from_settings())._keys.fetched_at -= (
        oidc.UNKNOWN_KID_REFRESH_SECONDS + 1
    )  # type: ignore[union-attr,arg-type]
    refusal = refusal_of(provider, provider.sign(provider.claims(), key=stranger))
    assert refusal.code == "id_token_unknown_key"
    assert "a key ('key-x', RS256) the provider does not publish" in refusal.message
    assert provider.hits["jwks"] == 2
    # Another made-up kid right away does not make another request.
    assert refusal_of(provider, provider.sign(provider.claims(), key=stranger)).code == (
        "id_token_unknown_key"
    )
    assert provider.hits["jwks"] == 2


def test_a_rotated_key_is_found_by_reading_the_keys_again(
    provider: StubProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(oidc, "UNKNOWN_KID_REFRESH_SECONDS", 0)
    verify(provider, provider.sign(provider.claims(nonce="n-0")), nonce="n-0")
    rotated = RSAKey.generate_key(2048, parameters={"kid": "key-2"})
    provider.keys = [provider.key, rotated]
    claims = verify(provider, provider.sign(provider.claims(), key=rotated))
    assert claims.subject == "subject-1"
    assert provider.hits["jwks"] == 2


def test_the_documents_are_read_again_after_their_max_age(provider: StubProvider) -> None:
    verify(provider, provider.sign(provider.claims(nonce="n-0")), nonce="n-0")
    # Both documents kept longer than their max age.
    kept = provider_for(ProviderConfig.from_settings())
    kept._metadata_at -= oidc.MAX_AGE_SECONDS + 1
    kept._keys.fetched_at -= oidc.MAX_AGE_SECONDS + 1  # type: ignore[union-attr]
    verify(provider, provider.sign(provider.claims()))
    assert provider.hits == {"discovery": 2, "jwks": 2}


def test_a_symmetric_key_in_the_jwks_is_never_used(provider: StubProvider) -> None:
    from joserfc.jwk import OctKey

    secret = OctKey.import_key(b"a shared secret of thirty-two bytes!", parameters={"kid": "oct"})
    provider.keys = [provider.key, secret]
    provider.discovery_extra = {"id_token_signing_alg_values_supported": ["RS256", "HS256"]}
    token = provider.sign(provider.claims(), key=secret, alg="HS256")
    assert refusal_of(provider, token).code == "id_token_algorithm_refused"


# -- the documents -----------------------------------------------------------------------------


def test_it_refuses_a_provider_that_names_another_issuer(provider: StubProvider) -> None:
    provider.discovery_extra = {"issuer": "https://login.example.com"}
    refusal = refusal_of(provider, provider.sign(provider.claims()))
    assert (refusal.code, refusal.status) == ("provider_issuer_mismatch", 502)
    assert "set LLMGW_OIDC_ISSUER to exactly the issuer it names" in refusal.message


@pytest.mark.parametrize(
    "jwks_uri", ["http://169.254.169.254/latest/meta-data", "http://127.0.0.1:1/jwks"]
)
def test_it_asks_no_host_but_the_issuers(provider: StubProvider, jwks_uri: str) -> None:
    provider.discovery_extra = {"jwks_uri": jwks_uri}
    refusal = refusal_of(provider, provider.sign(provider.claims()))
    assert (refusal.code, refusal.status) == ("provider_endpoint_refused", 502)
    assert "is not in LLMGW_OIDC_ISSUER's host (nor in LLMGW_OIDC_ALLOWED_HOSTS)" in refusal.message


def test_it_asks_a_host_named_in_the_allowed_hosts(provider: StubProvider, settings: Any) -> None:
    # Google's keys are on www.googleapis.com: named in LLMGW_OIDC_ALLOWED_HOSTS, asked.
    port = provider.issuer.rsplit(":", 1)[1]
    provider.discovery_extra = {"jwks_uri": f"http://localhost:{port}/jwks"}
    settings.LLMGW_OIDC_ALLOWED_HOSTS = [f"localhost:{port}"]
    assert verify(provider, provider.sign(provider.claims())).subject == "subject-1"


def test_it_does_not_follow_a_redirect(provider: StubProvider) -> None:
    provider.jwks_answer = (302, {"Location": "http://169.254.169.254/"}, b"{}")
    refusal = refusal_of(provider, provider.sign(provider.claims()))
    assert refusal.code == "provider_redirected"
    assert "answered with a redirect (302), which llmgw does not follow" in refusal.message


def test_it_reads_no_more_than_the_bound(provider: StubProvider) -> None:
    padding = "x" * (oidc.MAX_DOCUMENT_BYTES + 10)
    provider.jwks_answer = (200, {}, json.dumps({"keys": [], "padding": padding}).encode())
    refusal = refusal_of(provider, provider.sign(provider.claims()))
    assert refusal.code == "provider_answer_too_large"


def test_an_unreachable_provider_says_so(settings: Any, secret_file: Path) -> None:
    settings.LLMGW_OIDC_ISSUER = "http://127.0.0.1:9"
    settings.LLMGW_OIDC_CLIENT_ID = CLIENT_ID
    settings.LLMGW_OIDC_CLIENT_SECRET_FILE = str(secret_file)
    oidc.forget_providers()
    config = ProviderConfig.from_settings()
    assert config is not None
    with pytest.raises(Refused) as caught:
        provider_for(config).metadata()
    assert caught.value.status == 502
    assert "could not be reached (nothing answered there)" in caught.value.message
    assert "a break-glass administrator can still log in with a password" in caught.value.message
    oidc.forget_providers()


# -- the configuration -----------------------------------------------------------------------


def test_the_secret_file_must_be_the_owners_alone(secret_file: Path) -> None:
    assert read_client_secret(str(secret_file)) == "s3cret with spaces & symbols"
    os.chmod(secret_file, 0o640)
    with pytest.raises(Refused) as caught:
        read_client_secret(str(secret_file))
    assert f"LLMGW_OIDC_CLIENT_SECRET_FILE='{secret_file}' may be read by others (mode 0640" in (
        caught.value.message
    )
    assert f"Run `chmod 600 {secret_file}`" in caught.value.message
    # The message never holds the secret.
    assert "s3cret" not in caught.value.message


def test_a_configuration_that_cannot_work_is_named_whole(tmp_path: Path) -> None:
    config = ProviderConfig(
        issuer="http://login.example.com",
        client_id="",
        secret_file=str(tmp_path / "missing"),
        scopes=("email",),
        groups_claim="groups",
    )
    problems = config.problems()
    assert problems[0].startswith("LLMGW_OIDC_ISSUER='http://login.example.com' is not https")
    assert "LLMGW_OIDC_CLIENT_ID is empty" in problems[1]
    assert "lacks openid" in problems[2]
    assert "cannot be read" in problems[3]


def test_the_authorization_request_carries_state_nonce_and_an_s256_challenge(
    provider: StubProvider,
) -> None:
    from urllib.parse import parse_qs, urlsplit

    config = ProviderConfig.from_settings()
    url = provider_for(config).authorization_url(  # type: ignore[arg-type]
        state="st", nonce="no", verifier="ve" * 30, redirect_uri="http://testserver/signin/callback"
    )
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    assert url.startswith(f"{provider.issuer}/authorize?")
    digest = hashlib.sha256(("ve" * 30).encode()).digest()
    assert query == {
        "response_type": "code",
        "client_id": CLIENT_ID,
        "redirect_uri": "http://testserver/signin/callback",
        "scope": "openid email profile groups offline_access",
        "state": "st",
        "nonce": "no",
        "code_challenge": base64.urlsafe_b64encode(digest).rstrip(b"=").decode(),
        "code_challenge_method": "S256",
    }


def test_a_process_refuses_to_start_with_a_secret_others_may_read(
    settings: Any, secret_file: Path
) -> None:
    from django.apps import apps
    from django.core.exceptions import ImproperlyConfigured

    settings.LLMGW_OIDC_ISSUER = "https://login.example.com"
    settings.LLMGW_OIDC_CLIENT_ID = CLIENT_ID
    settings.LLMGW_OIDC_CLIENT_SECRET_FILE = str(secret_file)
    apps.get_app_config("signin").ready()  # owner-only: it starts
    os.chmod(secret_file, 0o644)
    with pytest.raises(ImproperlyConfigured) as caught:
        apps.get_app_config("signin").ready()
    message = str(caught.value)
    assert message.startswith("Sign-in through a provider (LLMGW_OIDC_ISSUER) cannot work: ")
    assert "may be read by others (mode 0644" in message
    assert message.endswith("Fix these, or unset LLMGW_OIDC_ISSUER to turn it off.")
