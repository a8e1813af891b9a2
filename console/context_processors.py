"""What every console page shows besides its own content."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from core.diskspace import var_space


def disk_space(request: HttpRequest) -> dict[str, Any]:
    """The banner's sentence while the disk holding LLMGW_VAR_DIR has less room than
    LLMGW_VAR_LOW_FREE_MB (one statvfs call a page), for those logged in; else nothing."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    space = var_space()
    return {"var_space_warning": space.warning() if space is not None and space.low else ""}
