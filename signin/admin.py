"""Identities in the admin: read-only (the provider's sign-ins write them), the refresh token
never shown. Deleting one unlinks the person: their next sign-in makes a new user."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import Identity

# The admin's login page offers the provider's sign-in too (and says when its form is for the
# break-glass administrators only).
admin.site.login_template = "signin/admin_login.html"


@admin.register(Identity)
class IdentityAdmin(admin.ModelAdmin):
    list_display = ("user", "issuer", "subject", "signed_in_at")
    search_fields = ("user__username", "subject", "user__email")
    fields = ("user", "issuer", "subject", "groups", "signed_in_at", "created_at")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
