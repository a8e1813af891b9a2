"""A small OpenID Connect provider on 127.0.0.1 for the sign-in's unit and view tests: a real
HTTP server (discovery, JWKS, token endpoint) whose answers a test sets, counting each request.

It signs what the test asks, however wrong: the checks under test are llmgw's. The browser
tests sign in against a real provider (tests/support/oidc_provider.py).
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from joserfc import jwt
from joserfc.jwk import Key, RSAKey

CLIENT_ID = "llmgw-test"
CLIENT_SECRET = "s3cret with spaces & symbols"

TokenAnswer = Callable[[dict[str, str]], tuple[int, Any]]


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class StubProvider:
    def __init__(self) -> None:
        self.key = RSAKey.generate_key(2048, parameters={"kid": "key-1", "use": "sig"})
        self.keys: list[Key] = [self.key]
        self.hits: Counter[str] = Counter()
        self.token_requests: list[dict[str, Any]] = []
        self.discovery_extra: dict[str, Any] = {}
        self.jwks_answer: tuple[int, dict[str, str], bytes] | None = None
        self.token_answer: TokenAnswer = lambda form: (400, {"error": "invalid_grant"})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> StubProvider:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        self.keys = [self.key]
        self.hits.clear()
        self.token_requests.clear()
        self.discovery_extra = {}
        self.jwks_answer = None
        self.token_answer = lambda form: (400, {"error": "invalid_grant"})

    # What it serves ---------------------------------------------------------------------

    def discovery(self) -> dict[str, Any]:
        return {
            "issuer": self.issuer,
            "authorization_endpoint": f"{self.issuer}/authorize",
            "token_endpoint": f"{self.issuer}/token",
            "jwks_uri": f"{self.issuer}/jwks",
            "id_token_signing_alg_values_supported": ["RS256"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic"],
            **self.discovery_extra,
        }

    def claims(self, **changes: Any) -> dict[str, Any]:
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "sub": "subject-1",
            "aud": CLIENT_ID,
            "exp": now + 300,
            "iat": now,
            "nonce": "nonce-1",
            "preferred_username": "dana",
            "email": "dana@example.com",
            "email_verified": True,
            "given_name": "Dana",
            "family_name": "Scully",
            "groups": ["llm-users"],
        }
        claims.update(changes)
        return {k: v for k, v in claims.items() if v is not None}

    def sign(self, claims: dict[str, Any], *, key: Key | None = None, alg: str = "RS256") -> str:
        key = key or self.key
        header = {"alg": alg, "typ": "JWT", **({"kid": key.kid} if key.kid else {})}
        return jwt.encode(header, claims, key, algorithms=[alg])

    def answer_with(self, id_token: str, **extra: Any) -> None:
        self.token_answer = lambda form: (
            200,
            {"access_token": "at", "token_type": "Bearer", "id_token": id_token, **extra},
        )

    # The server -------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/.well-known/openid-configuration":
                    provider.hits["discovery"] += 1
                    self.send(200, provider.discovery())
                elif self.path == "/jwks":
                    provider.hits["jwks"] += 1
                    if provider.jwks_answer is not None:
                        status, headers, body = provider.jwks_answer
                        self.send(status, body, headers)
                    else:
                        keys = [k.as_dict(private=False) for k in provider.keys]
                        self.send(200, {"keys": keys})
                else:
                    self.send(404, {"error": "not_found"})

            def do_POST(self) -> None:
                if self.path != "/token":
                    self.send(404, {"error": "not_found"})
                    return
                provider.hits["token"] += 1
                length = int(self.headers.get("Content-Length") or 0)
                form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
                provider.token_requests.append(
                    {"form": form, "authorization": self.headers.get("Authorization", "")}
                )
                status, body = provider.token_answer(form)
                self.send(status, body)

        return Handler
