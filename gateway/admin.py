"""Gateway keys in the admin: read-only (keys are made by their owners), plus a revoke action."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from catalog.services import Actor

from . import services
from .models import GatewayKey


@admin.register(GatewayKey)
class GatewayKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "owner", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "prefix", "owner__username"]
    list_select_related = ["owner"]
    readonly_fields = [
        "name",
        "owner",
        "prefix",
        "created_at",
        "last_used_at",
        "revoked_at",
        "revoked_by",
    ]
    exclude = ["key_hash"]
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a key is shown once, to whoever creates it: the owner, in the console or CLI

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # revoked keys stay, so that who had which key is still known

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[GatewayKey]) -> None:
        actor = Actor.for_user(request.user, "admin")
        revoked = 0
        for key in queryset.filter(revoked_at__isnull=True):
            services.key_revoke(actor=actor, key_id=key.pk)
            revoked += 1
        self.message_user(
            request,
            f"{revoked} key(s) revoked; requests with them now get 401."
            if revoked
            else "The selected keys were already revoked.",
            messages.SUCCESS if revoked else messages.INFO,
        )
