from __future__ import annotations

from django.contrib import admin

from core.admin import ReadOnlyAdmin

from .models import Fetch, MirrorFile, Rollout


@admin.register(Rollout)
class RolloutAdmin(ReadOnlyAdmin):
    list_display = [
        "model",
        "kind",
        "state",
        "from_commit_short",
        "to_commit_short",
        "replaced",
        "total",
        "actor_name",
        "created_at",
        "finished_at",
    ]
    list_filter = ["kind", "state", "door"]
    search_fields = ["model__name", "actor_name", "from_commit", "to_commit", "message"]
    list_select_related = ["model"]

    @admin.display(description="from")
    def from_commit_short(self, obj: Rollout) -> str:
        return obj.from_commit[:8]

    @admin.display(description="to")
    def to_commit_short(self, obj: Rollout) -> str:
        return obj.to_commit[:8]


@admin.register(Fetch)
class FetchAdmin(ReadOnlyAdmin):
    list_display = [
        "repo",
        "branch",
        "commit_short",
        "state",
        "bytes_done",
        "bytes_total",
        "door",
        "created_at",
        "finished_at",
    ]
    list_filter = ["state", "door"]
    search_fields = ["repo", "commit", "message"]

    @admin.display(description="commit")
    def commit_short(self, obj: Fetch) -> str:
        return obj.commit[:8]


@admin.register(MirrorFile)
class MirrorFileAdmin(ReadOnlyAdmin):
    list_display = ["repo", "commit_short", "path", "size", "sha256", "fetched_at"]
    search_fields = ["repo", "commit", "path", "sha256"]
    list_filter = ["repo"]

    @admin.display(description="commit")
    def commit_short(self, obj: MirrorFile) -> str:
        return obj.commit[:8]
