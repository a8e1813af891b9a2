"""Who may read the mirror's files: nodes, logged-in people, and the control plane itself.

The mirror holds every model's weights; anonymous reads are refused. A node sends its node
token (the agent sends `Authorization: Bearer <node token>` to the control plane's own
origin), a person an API token or a console session, and the control plane's own checks
(source checks, adapter and GGUF header reads) a token derived from the secret key that
every web and worker process shares.

It lives here, above catalog and fleet, because it asks both: node tokens are fleet's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.http import HttpRequest, HttpResponse

from accounts.services import token_user
from catalog.mirror_credential import is_control_plane_token
from fleet.services import authenticate_node

from .auth import credential_of


def mirror_reader(request: HttpRequest) -> str | None:
    """Who is reading ("control plane", "node NAME", "user NAME"), or None when nobody known."""
    secret = credential_of(request.META.get("HTTP_AUTHORIZATION", ""))
    if secret is not None:
        if is_control_plane_token(secret):
            return "control plane"
        node = authenticate_node(secret)
        if node is not None:
            return f"node {node.name}"
        user = token_user(secret)
        return f"user {user.get_username()}" if user is not None else None
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user {user.get_username()}"
    return None


def mirror_access(view: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(view)
    def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        if mirror_reader(request) is None:
            refusal = HttpResponse(
                "The mirror serves its files to nodes and logged-in people only: send a node "
                "token or an API token as 'Authorization: Bearer TOKEN', or log in to the "
                "console.\n",
                status=401,
                content_type="text/plain; charset=utf-8",
            )
            refusal["WWW-Authenticate"] = 'Bearer realm="llmgw mirror"'
            return refusal
        return view(request, *args, **kwargs)

    return guarded
