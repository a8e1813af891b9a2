"""API tokens in the admin: listed by user, name and first characters, never the token.

A token added here is generated and shown once, in the message after saving.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest

from llmgw.bearer import API_TOKEN, digest

from .models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("prefix", "user", "name", "created_at", "last_used_at")
    list_filter = ("user",)
    search_fields = ("user__username", "name", "prefix")
    fields = ("user", "name", "prefix", "created_at", "last_used_at")
    readonly_fields = ("prefix", "created_at", "last_used_at")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # A token's user is fixed once it exists; issue a new token for someone else.
        return (*self.readonly_fields, "user") if obj is not None else self.readonly_fields

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        secret = API_TOKEN.new()
        obj.prefix, obj.digest = API_TOKEN.shown_part(secret), digest(secret)
        super().save_model(request, obj, form, change)
        messages.warning(
            request,
            f"The new token for {obj.user} is {secret} — copy it now: it is shown only this once "
            "(only its hash is kept).",
        )
