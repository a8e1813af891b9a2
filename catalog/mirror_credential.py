"""The control plane's own credential for reading its mirror (/mirror/, served by the registry
app): the source check of a model whose weights are in the mirror sends it, and the mirror's
access check (llmgw_site.access) accepts it. It is derived from SECRET_KEY, so it is never stored.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

import requests
from django.conf import settings


def _control_plane_token() -> str:
    return hmac.new(
        settings.SECRET_KEY.encode(), b"llmgw: the control plane reads its mirror", hashlib.sha256
    ).hexdigest()


def is_control_plane_token(secret: str) -> bool:
    return hmac.compare_digest(secret.encode(), _control_plane_token().encode())


class ControlPlaneAuth(requests.auth.AuthBase):
    """Sends the control plane's mirror credential, to its own origin only: a source or a
    redirect on another host never sees it."""

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        own = urlsplit(settings.LLMGW_PUBLIC_URL)
        target = urlsplit(request.url or "")
        if (target.scheme, target.netloc) == (own.scheme, own.netloc):
            request.headers["Authorization"] = f"Bearer {_control_plane_token()}"
        return request
