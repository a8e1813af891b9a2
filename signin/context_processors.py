"""What the login pages (the console's and the admin's) need to offer the right ways in."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest


def signin(request: HttpRequest) -> dict[str, Any]:
    return {
        "signin": {
            "provider": bool(settings.LLMGW_OIDC_ISSUER.strip()),
            "provider_name": settings.LLMGW_OIDC_PROVIDER_NAME,
            "local_passwords": settings.LLMGW_LOCAL_PASSWORDS,
        }
    }
