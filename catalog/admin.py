"""The catalog in the Django admin: the same changes as the API and the console, through the
same services, with the admin user as the actor and "admin" as the door.
"""

from __future__ import annotations

from typing import Any

import yaml
from django import forms
from django.contrib import admin, messages
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from core.actor import Actor
from core.admin import ReadOnlyAdmin, RemovedThroughServiceAdmin, RequestFormAdmin, admin_actor
from core.refusals import Problem, Refused, invalid
from core.yamltext import Path, line_for

from . import services
from .definitions import clean_definition, load_definition_text
from .models import AuditEntry, CatalogVersion, Model

# Parts of a definition that no service changes in place; the rest map to one service each.
FIXED = (
    "name",
    "source",
    "sha256",
    "mmproj",
    "engine",
    "files",
    "reranking",
    "description",
    "fallbacks",
    "context_length",
    "routing",
)
# What a model's page shows as in force, beside its editable definition.
IN_FORCE = (
    "name",
    "owner",
    "class_shown",
    "scaling",
    "declared",
    "generation",
    "source",
    "origin_commit",
    "update_shown",
    "rollout_halted",
    "console_link",
)


def definition_text(model: Model) -> str:
    return yaml.safe_dump(model.definition(), sort_keys=False, allow_unicode=True, width=1000)


def _parse(text: str) -> tuple[dict[str, Any], dict[Path, int]]:
    data, lines = load_definition_text(text)
    return clean_definition(data, lines=lines), lines


def edit_model(
    actor: Actor, model: Model, wanted: dict[str, Any], lines: dict[Path, int], source_check: bool
) -> Model:
    """Bring a model to the definition edited in the admin, one service per kind of change, or
    refuse what no service changes in place (with the line it is on)."""
    current = clean_definition(model.definition())
    _refuse_changes_not_made_in_place(current, wanted, lines)
    with transaction.atomic():
        _change_through_services(actor, model.name, current, wanted, source_check)
    return Model.objects.select_related("owner").get(name=model.name)


def _refuse_changes_not_made_in_place(
    current: dict[str, Any], wanted: dict[str, Any], lines: dict[Path, int]
) -> None:
    fixed = [key for key in FIXED if current.get(key) != wanted.get(key)]
    if fixed:
        raise invalid(
            [
                Problem(
                    key,
                    "cannot be changed in place: the admin changes a model through the same "
                    "operations as the API (scale, resources, class, owner, adapters). Remove the "
                    "model and add it again with the new definition",
                    line_for(lines, (key,)),
                )
                for key in fixed
            ]
        )
    by_name = {p["name"]: p for p in current["profiles"]}
    reshaped = [
        index
        for index, profile in enumerate(wanted["profiles"])
        if profile["name"] not in by_name or _shape(profile) != _shape(by_name[profile["name"]])
    ]
    if reshaped or len(wanted["profiles"]) != len(current["profiles"]):
        index = reshaped[0] if reshaped else 0
        problem = (
            "only memory_gb and cores of the existing profiles can be changed here; to add, "
            "remove, rename or give GPUs to a profile, remove the model and add it again"
        )
        raise invalid([Problem("profiles", problem, line_for(lines, ("profiles", index)))])
    if current.get("owner") and not wanted.get("owner"):
        problem = "a model keeps an owner here: name the user to hand it to"
        raise invalid([Problem("owner", problem, line_for(lines, ("owner",)))])


def _shape(profile: dict[str, Any]) -> dict[str, Any]:
    """What of a profile the admin does not change in place: all but memory_gb and cores."""
    return {k: v for k, v in profile.items() if k not in ("memory_gb", "cores")}


def _change_through_services(
    actor: Actor, name: str, current: dict[str, Any], wanted: dict[str, Any], source_check: bool
) -> None:
    if wanted.get("owner") and wanted["owner"] != current.get("owner"):
        services.model_set_owner(actor=actor, name=name, username=wanted["owner"])
    if (wanted["class"] or "") != (current["class"] or ""):
        services.model_set_class(actor=actor, name=name, klass=wanted["class"] or "default")
    scale = ("min_replicas", "max_replicas", "idle_timeout")
    if any(wanted[key] != current[key] for key in scale):
        services.model_scale(
            actor=actor,
            name=name,
            min_replicas=wanted["min_replicas"],
            max_replicas=wanted["max_replicas"],
            idle_timeout=wanted["idle_timeout"],
        )
    by_name = {p["name"]: p for p in current["profiles"]}
    for profile in wanted["profiles"]:
        before = by_name[profile["name"]]
        if (profile["memory_gb"], profile["cores"]) != (before["memory_gb"], before["cores"]):
            services.model_set_resources(
                actor=actor,
                name=name,
                memory_gb=profile["memory_gb"],
                cores=profile["cores"],
                profile=profile["name"],
            )
    # Removed first, then added: an adapter whose entry changed is replaced.
    had = {a["name"]: a for a in current["adapters"]}
    want = {a["name"]: a for a in wanted["adapters"]}
    remove = [n for n in had if want.get(n) != had[n]]
    add = [a for a in wanted["adapters"] if had.get(a["name"]) != a]
    if add or remove:
        services.model_set_adapters(
            actor=actor, name=name, add=add, remove=remove, source_check=source_check
        )


class ModelAdminForm(forms.ModelForm):
    definition_yaml = forms.CharField(
        label="Definition (YAML)",
        widget=forms.Textarea(
            attrs={"rows": 20, "cols": 100, "spellcheck": "false", "class": "vLargeTextField"}
        ),
        help_text="The same YAML as a models: entry in server.yaml or `llmgw ctl model add -f`. "
        "On a model already in the catalog, the scale, class, owner, the memory and cores of its "
        "profiles and its adapters can be changed here; each change is checked against the whole "
        "catalog and recorded in the audit trail.",
    )
    skip_source_check = forms.BooleanField(
        label="Skip the source check",
        required=False,
        help_text="Otherwise the control plane asks the source URL (and each new adapter's) whether "
        "the file is there before storing it. Skip it when the mirror is not up yet, or nodes "
        "reach it by an address the control plane does not.",
    )

    # Set per request by ModelAdmin.get_form: the services need to know who acts.
    request: HttpRequest

    class Meta:
        model = Model
        fields: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk and not self.is_bound:
            self.initial["definition_yaml"] = definition_text(self.instance)

    def clean(self) -> dict[str, Any] | None:
        # The services are called here, not from save_model(): the admin offers no later hook
        # that can still put a service's refusal on the form rather than answer a server error.
        # The admin runs the view in one transaction and the changes of one save in a savepoint,
        # so a refused second change undoes the first.
        data = super().clean() or {}
        if self.errors:
            return data
        actor = admin_actor(self.request)
        lines: dict[Path, int] = {}
        try:
            wanted, lines = _parse(data["definition_yaml"])
            if self.instance.pk is None:
                self.instance = services.model_add(
                    actor=actor, definition=wanted, source_check=not data["skip_source_check"]
                )
            else:
                self.instance = edit_model(
                    actor, self.instance, wanted, lines, not data["skip_source_check"]
                )
        except Refused as error:
            self.add_error(None, error.message)
            for problem in error.problems:
                self.add_error("definition_yaml", str(problem))
        return data


@admin.register(Model)
class ModelAdmin(RemovedThroughServiceAdmin, RequestFormAdmin):
    form = ModelAdminForm
    list_display = [
        "name",
        "owner",
        "class_shown",
        "scaling",
        "declared",
        "origin_commit",
        "update_shown",
        "updated_at",
    ]
    list_filter = ["declared", "model_class", ("owner", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["name", "description", "owner__username", "source"]
    list_select_related = ["owner"]
    list_per_page = 50
    actions = ["restart_models", "remove_models"]
    readonly_fields = [*IN_FORCE, "created_at", "updated_at"]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        editing = [("Definition", {"fields": ["definition_yaml", "skip_source_check"]})]
        if obj is None:
            return editing
        in_force = [*IN_FORCE, ("created_at", "updated_at")]
        return [("In force", {"fields": in_force}), *editing]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return self.readonly_fields if obj is not None else []

    def save_model(self, request: HttpRequest, obj: Model, form: Any, change: bool) -> None:
        """Nothing to save: the form's clean() made the change through the services."""

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """Nothing related is edited here."""

    def delete_model(self, request: HttpRequest, obj: Model) -> None:
        services.model_remove(actor=admin_actor(request), name=obj.name)

    def refused_removal_url(self, object_id: str) -> str:
        return reverse("admin:catalog_model_change", args=[object_id])

    @admin.action(description="Rolling restart of the selected models")
    def restart_models(self, request: HttpRequest, queryset: QuerySet[Model]) -> None:
        self._each(request, queryset, "Rolling restart asked for", services.model_restart)

    @admin.action(description="Remove the selected models")
    def remove_models(self, request: HttpRequest, queryset: QuerySet[Model]) -> None:
        self._each(request, queryset, "Removed", services.model_remove)

    def _each(
        self, request: HttpRequest, queryset: QuerySet[Model], done: str, service: Any
    ) -> None:
        names = list(queryset.values_list("name", flat=True))
        succeeded = []
        for name in names:
            try:
                service(actor=admin_actor(request), name=name)
            except Refused as error:
                self.message_user(request, error.message, messages.ERROR)
            else:
                succeeded.append(name)
        if succeeded:
            self.message_user(request, f"{done}: {', '.join(succeeded)}.", messages.SUCCESS)

    @admin.display(description="class", ordering="model_class")
    def class_shown(self, obj: Model) -> str:
        return obj.class_in_force + ("" if obj.model_class else " (default)")

    @admin.display(description="scaling")
    def scaling(self, obj: Model) -> str:
        if obj.parked:
            return "not running (0/0)"
        if obj.on_demand:
            return f"on demand, up to {obj.effective_max}"
        return f"{obj.min_replicas} (max {obj.effective_max})"

    @admin.display(description="commit")
    def origin_commit(self, obj: Model) -> str:
        return (obj.origin or {}).get("commit", "")[:8] or "—"

    @admin.display(description="update", boolean=False)
    def update_shown(self, obj: Model) -> str:
        return (obj.update_available or {}).get("commit", "")[:8] or "—"

    @admin.display(description="console")
    def console_link(self, obj: Model) -> str:
        return format_html(
            '<a href="{}">{}</a>', reverse("console-model", args=[obj.name]), "open in the console"
        )


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ["at", "actor_name", "door", "action", "model_name", "changed"]
    list_filter = ["action", "door", "at"]
    search_fields = ["model_name", "actor_name", "note"]
    date_hierarchy = "at"
    list_per_page = 50
    fields = readonly_fields = (
        "at",
        "actor_name",
        "door",
        "action",
        "model_name",
        "changes_table",
        "note",
        "before",
        "after",
    )

    @admin.display(description="changed")
    def changed(self, obj: AuditEntry) -> str:
        return ", ".join(obj.changes or {}) or "—"

    @admin.display(description="changes")
    def changes_table(self, obj: AuditEntry) -> str:
        if not obj.changes:
            return "—"
        return format_html(
            "<table>{}</table>",
            format_html_join(
                "",
                "<tr><th>{}</th><td>{}</td><td>→</td><td>{}</td></tr>",
                ((key, _shown(old), _shown(new)) for key, (old, new) in obj.changes.items()),
            ),
        )


def _shown(value: Any) -> str:
    if value is None:
        return "—"
    return (
        value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
    )


@admin.register(CatalogVersion)
class CatalogVersionAdmin(ReadOnlyAdmin):
    """The row every catalog write locks and bumps; shown so that its count can be checked."""

    list_display = ["pk", "version"]
