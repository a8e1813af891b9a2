"""Admin: read-only for now.

Catalog changes must go through the services (validation of the whole
catalog, audit in the same transaction); until the admin's forms call them,
the admin shows the catalog and the trail without editing them.
"""

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import AuditEntry, Model


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Model)
class ModelAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        "owner",
        "model_class",
        "min_replicas",
        "max_replicas",
        "declared",
        "updated_at",
    ]
    list_filter = ["declared", "model_class"]
    search_fields = ["name", "description", "owner__username"]
    list_select_related = ["owner"]


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ["at", "actor_name", "door", "action", "model_name"]
    list_filter = ["action", "door"]
    search_fields = ["model_name", "actor_name", "note"]
