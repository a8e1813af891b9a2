"""The admin kit: admins that change rows through the services, as the request's user, so the
admin gets every check and audit entry the other doors get.

A service's refusal (core.refusals.Refused) is shown on the form or as a message, never as a
server error; the stock bulk delete, which would bypass the services, is not offered; rows that
only the system writes are read-only.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from .actor import Actor
from .refusals import Refused

ADMIN = "admin"


def admin_actor(request: HttpRequest) -> Actor:
    return Actor.for_user(request.user, ADMIN)


class RequestFormAdmin(admin.ModelAdmin):
    """Admins whose form makes its change through the services, as the request's user: the form
    is given the request, and the stock bulk delete, which bypasses the services (no checks, no
    audit), is not offered."""

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        form = super().get_form(request, obj, change, **kwargs)
        # A subclass per request: the class attribute must not be shared between requests.
        return type(form.__name__, (form,), {"request": request})

    def get_actions(self, request: HttpRequest) -> Any:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions


class RemovedThroughServiceAdmin(admin.ModelAdmin):
    """Rows a service removes (delete_model calls it): its refusal is shown, not a 500."""

    def refused_removal_url(self, object_id: str) -> str:
        raise NotImplementedError

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        try:
            return super().delete_view(request, object_id, extra_context)
        except Refused as error:
            self.message_user(request, error.message, messages.ERROR)
            return HttpResponseRedirect(self.refused_removal_url(object_id))


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows that only the services, tasks, the reconciler and the agents' heartbeats write."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
