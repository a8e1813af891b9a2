"""/signin/start and /signin/callback through Django's test client, against the stub provider:
state, nonce and next, people made and kept up to date, and every refusal changing nothing."""

from __future__ import annotations

import base64
import hashlib
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from catalog.models import AuditEntry
from signin.models import Identity
from tests.signin.stub_provider import CLIENT_ID, CLIENT_SECRET, StubProvider

pytestmark = [pytest.mark.django_db]

roles = pytest.importorskip(
    "access.roles", reason="access.roles (the group mapping) is not here yet"
)


def begin(client: Client, next_url: str | None = None) -> dict[str, str]:
    """Start a sign-in; the authorization request's parameters."""
    answer = client.get("/signin/start", {"next": next_url} if next_url is not None else {})
    assert answer.status_code == 302, answer.content
    return {k: v[0] for k, v in parse_qs(urlsplit(answer["Location"]).query).items()}


def finish(client: Client, request: dict[str, str], **params: str) -> Any:
    return client.get("/signin/callback", {"state": request["state"], "code": "code-1", **params})


def sign_in(
    client: Client, provider: StubProvider, next_url: str | None = None, **claims: Any
) -> Any:
    request = begin(client, next_url)
    provider.answer_with(
        provider.sign(provider.claims(nonce=request["nonce"], **claims)), refresh_token="rt-1"
    )
    return finish(client, request)


def audit(action: str) -> list[tuple[str, str, str]]:
    return [
        (e.model_name, e.door, e.note)
        for e in AuditEntry.objects.filter(action=action).order_by("id")
    ]


def nothing_made() -> bool:
    return not get_user_model().objects.exists() and not Identity.objects.exists()


def test_a_first_sign_in_makes_the_person_and_logs_them_in(provider: StubProvider) -> None:
    client = Client()
    request = begin(client, "/models/tiny-chat/")
    assert request["redirect_uri"] == "http://testserver/signin/callback"
    provider.answer_with(
        provider.sign(provider.claims(nonce=request["nonce"])), refresh_token="rt-1"
    )
    answer = finish(client, request)
    assert (answer.status_code, answer["Location"]) == (302, "/models/tiny-chat/")

    user = get_user_model().objects.get()
    assert (user.username, user.email, user.first_name, user.last_name) == (
        "dana",
        "dana@example.com",
        "Dana",
        "Scully",
    )
    assert not user.has_usable_password()
    identity = Identity.objects.get()
    assert (identity.issuer, identity.subject, identity.groups) == (
        provider.issuer,
        "subject-1",
        ["llm-users"],
    )
    # The refresh token is kept sealed, readable through signin.people only.
    from signin.people import refresh_token_of

    assert "rt-1" not in identity.refresh_token
    assert refresh_token_of(identity) == "rt-1"
    # The groups were mapped: a member of research.
    assert list(user.llmgw_teams.values_list("name", flat=True)) == ["research"]
    # Logged in: the console answers.
    assert client.get("/").status_code == 200
    assert audit("sign-in") == [
        ("user dana", "console", "first sign-in: the account was made (provider)")
    ]

    # The token request: the code, the PKCE verifier of the challenge sent, the client's
    # credentials in the Authorization header (never in the URL or the form).
    (sent,) = provider.token_requests
    verifier = sent["form"]["code_verifier"]
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=")
    assert challenge.decode() == request["code_challenge"]
    assert sent["form"] == {
        "grant_type": "authorization_code",
        "code": "code-1",
        "redirect_uri": "http://testserver/signin/callback",
        "code_verifier": verifier,
    }
    user_and_secret = base64.b64decode(sent["authorization"].removeprefix("Basic ")).decode()
    assert user_and_secret == f"{CLIENT_ID}:s3cret+with+spaces+%26+symbols"
    assert CLIENT_SECRET not in str(sent["form"])


def test_the_next_sign_in_brings_email_name_and_groups_up_to_date(
    provider: StubProvider,
) -> None:
    sign_in(Client(), provider)
    answer = sign_in(
        Client(),
        provider,
        email="dana.scully@example.com",
        given_name="Dana K.",
        groups=["llm-admins"],
        preferred_username="someone-else",
    )
    assert answer.status_code == 302
    user = get_user_model().objects.get()
    # The username stays what it was made as.
    assert (user.username, user.email, user.first_name) == (
        "dana",
        "dana.scully@example.com",
        "Dana K.",
    )
    assert Identity.objects.get().groups == ["llm-admins"]
    # llm-admins gives admin (staff); llm-users is gone, and with it the team.
    assert user.is_staff
    assert not user.llmgw_teams.exists()
    entry = AuditEntry.objects.filter(action="sign-in").latest("id")
    assert entry.changes == {
        "email": ["dana@example.com", "dana.scully@example.com"],
        "first_name": ["Dana", "Dana K."],
        "groups": [["llm-users"], ["llm-admins"]],
    }


def test_a_person_is_found_by_issuer_and_subject_never_by_email(
    provider: StubProvider, users: dict[str, Any]
) -> None:
    alice = users["alice"]
    alice.email = "alice@example.com"
    alice.save()
    sign_in(
        Client(), provider, sub="another-subject", preferred_username="alice", email=alice.email
    )
    made = get_user_model().objects.get(signin_identity__subject="another-subject")
    assert made.username == "alice-2"
    assert made.pk != alice.pk
    alice.refresh_from_db()
    assert alice.check_password("alice-password-1")


def test_a_break_glass_name_is_never_given_to_a_provider_user(
    provider: StubProvider, settings: Any
) -> None:
    settings.LLMGW_BREAK_GLASS_USERS = ["admin"]
    sign_in(Client(), provider, preferred_username="Admin", email="")
    assert get_user_model().objects.get().username == "Admin-2"


def test_a_username_is_made_of_safe_characters_or_the_subject(provider: StubProvider) -> None:
    sign_in(Client(), provider, preferred_username="<script>dana</script>", email=None)
    sign_in(Client(), provider, sub="s-2", preferred_username="ünï", email="")
    names = sorted(get_user_model().objects.values_list("username", flat=True))
    assert names[0] == "scriptdanascript"
    assert names[1].startswith("user-") and len(names[1]) == 17


@pytest.mark.parametrize(
    ("next_url", "door", "landing"),
    [
        ("/keys/", "console", "/keys/"),
        ("/admin/access/team/", "admin", "/admin/access/team/"),
        ("https://evil.example/", "console", "/"),
        ("//evil.example/", "console", "/"),
        ("/\\evil.example/", "console", "/"),
        ("http://testserver/keys/", "console", "/"),
        ("javascript:alert(1)", "console", "/"),
    ],
)
def test_next_leads_only_to_a_path_of_this_site(
    provider: StubProvider, next_url: str, door: str, landing: str, settings: Any
) -> None:
    settings.LLMGW_OIDC_GROUP_MAP = "llm-users=admin"
    answer = sign_in(Client(), provider, next_url)
    assert (answer.status_code, answer["Location"]) == (302, landing)
    assert AuditEntry.objects.get(action="sign-in").door == door


def refused(answer: Any, status: int, words: str) -> None:
    assert answer.status_code == status, answer.content
    page = answer.content.decode()
    assert "Sign-in refused" in page
    assert words in page, page
    assert "_auth_user_id" not in answer.wsgi_request.session


def test_an_answer_for_a_state_this_session_did_not_start_is_refused(
    provider: StubProvider,
) -> None:
    mine, theirs = Client(), Client()
    request = begin(theirs)
    provider.answer_with(provider.sign(provider.claims(nonce=request["nonce"])))
    # A login CSRF: the attacker's own callback URL, opened in the victim's browser.
    answer = finish(mine, request)
    refused(answer, 400, "is not for a sign-in this browser started, or it was already used")
    assert nothing_made()
    assert provider.hits["token"] == 0
    assert audit("sign-in-refused")[0][:2] == ("user (unknown)", "console")
    assert "state does not match" in audit("sign-in-refused")[0][2]


def test_a_state_is_taken_once(provider: StubProvider) -> None:
    client = Client()
    request = begin(client)
    provider.answer_with(provider.sign(provider.claims(nonce=request["nonce"])))
    assert finish(client, request).status_code == 302
    client.logout()
    refused(finish(client, request), 400, "already used")
    assert provider.hits["token"] == 1


def test_a_missing_code_is_refused_and_spends_the_state(provider: StubProvider) -> None:
    client = Client()
    request = begin(client)
    answer = client.get("/signin/callback", {"state": request["state"]})
    refused(answer, 400, "holds no authorization code")
    refused(finish(client, request), 400, "already used")
    assert nothing_made()


def test_the_providers_error_is_shown_and_changes_nothing(provider: StubProvider) -> None:
    client = Client()
    request = begin(client)
    answer = client.get(
        "/signin/callback",
        {
            "state": request["state"],
            "error": "access_denied",
            "error_description": "<b>The user is not assigned</b>",
        },
    )
    refused(answer, 400, "The provider did not sign you in (access_denied: ")
    assert "&lt;b&gt;The user is not assigned&lt;/b&gt;" in answer.content.decode()
    assert nothing_made()
    assert audit("sign-in-refused")[0][0] == "user (unknown)"


def test_a_tampered_token_is_refused_and_changes_nothing(provider: StubProvider) -> None:
    client = Client()
    request = begin(client)
    header, payload, signature = provider.sign(provider.claims(nonce=request["nonce"])).split(".")
    provider.answer_with(f"{header}.{payload}.{signature[:-4]}AAAA")
    refused(finish(client, request), 400, "the ID token&#x27;s signature does not match")
    assert nothing_made()


def test_a_token_of_an_earlier_sign_in_is_refused(provider: StubProvider) -> None:
    # The provider's answer replayed into another sign-in: its nonce is not the new one.
    first = Client()
    request = begin(first)
    old_token = provider.sign(provider.claims(nonce=request["nonce"]))
    provider.answer_with(old_token)
    assert finish(first, request).status_code == 302
    second = Client()
    request = begin(second)
    provider.answer_with(old_token)
    refused(finish(second, request), 400, "nonce is not the one this sign-in sent")


def test_the_code_refused_by_the_provider_is_a_clear_refusal(provider: StubProvider) -> None:
    client = Client()
    request = begin(client)
    provider.token_answer = lambda form: (400, {"error": "invalid_grant"})
    refused(finish(client, request), 400, "would not give tokens for this sign-in (invalid_grant)")
    assert nothing_made()


def test_groups_that_give_no_role_refuse_a_first_sign_in_and_keep_nothing(
    provider: StubProvider,
) -> None:
    answer = sign_in(Client(), provider, groups=["marketing"])
    refused(answer, 403, "dana&#x27;s groups (marketing) map to no role in llmgw")
    assert nothing_made()
    (entry,) = AuditEntry.objects.filter(action="sign-in-refused")
    assert (entry.model_name, entry.after["code"]) == ("user dana", "no_role")


def test_someone_whose_groups_no_longer_give_a_role_loses_them_and_is_refused(
    provider: StubProvider,
) -> None:
    sign_in(Client(), provider)
    user = get_user_model().objects.get()
    assert user.llmgw_teams.exists()
    answer = sign_in(Client(), provider, groups=["marketing"])
    refused(answer, 403, "map to no role in llmgw")
    assert Identity.objects.get().groups == ["marketing"]
    assert not user.llmgw_teams.exists()


def test_a_person_deactivated_in_llmgw_stays_out(provider: StubProvider) -> None:
    sign_in(Client(), provider)
    get_user_model().objects.update(is_active=False)
    answer = sign_in(Client(), provider, email="new@example.com", groups=["llm-admins"])
    refused(answer, 403, "was deactivated by an administrator")
    user = get_user_model().objects.get()
    assert (user.email, user.is_active, user.is_staff) == ("dana@example.com", False, False)
    assert Identity.objects.get().groups == ["llm-users"]


def test_sign_out_is_audited(provider: StubProvider) -> None:
    client = Client()
    sign_in(client, provider)
    assert client.post("/logout/").status_code == 200
    assert audit("sign-out") == [("user dana", "console", "logged out")]


def test_without_an_issuer_the_provider_pages_say_so(settings: Any) -> None:
    settings.LLMGW_OIDC_ISSUER = ""
    for path in ("/signin/start", "/signin/callback?state=x&code=y"):
        answer = Client().get(path)
        assert answer.status_code == 404
        assert "Sign-in through a provider is not configured" in answer.content.decode()


def test_a_provider_that_cannot_be_reached_is_a_502_page(
    provider: StubProvider, settings: Any
) -> None:
    from signin.oidc import forget_providers

    settings.LLMGW_OIDC_ISSUER = "http://127.0.0.1:9"
    forget_providers()
    answer = Client().get("/signin/start")
    assert answer.status_code == 502
    assert "could not be reached" in answer.content.decode()
