"""The fleet in the Django admin: nodes (added, cordoned, removed through the services), replicas and leases to look at."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Count, Q, QuerySet, Sum
from django.http import HttpRequest
from django.urls import reverse

from core.admin import ReadOnlyAdmin, RemovedThroughServiceAdmin, admin_actor
from core.refusals import Refused

from . import services
from .models import Lease, Node, RemovedNode, Replica


class NodeAddForm(forms.ModelForm):
    """The name, and the networks it may report besides the one it connects from: the agent
    reports the rest. The token is made by node_add and shown once."""

    request: HttpRequest  # set per request by NodeAdmin.get_form
    token: str = ""
    address_allow_text = forms.CharField(
        label="Address allow-list",
        required=False,
        help_text=(
            "networks (CIDR) or addresses, comma-separated, the node may report as its engines' "
            "address besides the one it connects from: for a node behind NAT or with several "
            "interfaces. Leave empty for most nodes."
        ),
    )

    class Meta:
        model = Node
        fields = ["name"]

    def validate_unique(self) -> None:
        """node_add says it in its own words when the name is taken."""

    def clean(self) -> dict[str, Any] | None:
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            self.instance, self.token = services.node_add(
                actor=admin_actor(self.request),
                name=data["name"],
                address_allow=[
                    item.strip()
                    for item in (data.get("address_allow_text") or "").split(",")
                    if item.strip()
                ],
            )
        except Refused as error:
            field = "address_allow_text" if error.code == "address_allow_invalid" else "name"
            self.add_error(field, error.message)
        return data


ACTIVE = Q(replicas__withdrawn_at__isnull=True)


# A node, as both its list row and its page begin.
CAPACITY_SHOWN = ("name", "state", "address", "memory", "cores_shown", "gpus")


@admin.register(Node)
class NodeAdmin(RemovedThroughServiceAdmin):
    list_display = [*CAPACITY_SHOWN, "replica_count", "last_heartbeat"]
    list_filter = ["cordoned", "lost"]
    search_fields = ["name", "address"]
    actions = ["cordon", "uncordon", "accept_capacity"]
    readonly_fields = [
        *CAPACITY_SHOWN,
        "gpu_memory_gb",
        "capacity_notes_shown",
        "reported_capacity",
        "registered_capacity",
        "address_allow",
        "port_first",
        "port_last",
        "replica_count",
        "cordoned",
        "lost",
        "last_heartbeat",
        "agent",
        "created_at",
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Node]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                reserved_memory=Sum("replicas__memory_gb", filter=ACTIVE),
                reserved_cores=Sum("replicas__cores", filter=ACTIVE),
                active_replicas=Count("replicas", filter=ACTIVE),
            )
        )

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        if obj is None:
            kwargs["form"] = NodeAddForm
        form = super().get_form(request, obj, change, **kwargs)
        return type(form.__name__, (form,), {"request": request})

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return ["name", "address_allow_text"] if obj is None else self.readonly_fields

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return [] if obj is None else self.readonly_fields

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The change page shows the node; cordoning is an action, the rest comes from its agent.
        return bool(obj is None and super().has_change_permission(request, obj))

    def save_model(self, request: HttpRequest, obj: Node, form: Any, change: bool) -> None:
        token = getattr(form, "token", "")
        if token:
            self.message_user(
                request,
                f"Node {obj.name} was added. Its token, shown only this once: {token} — start "
                f"`llmgw node --server URL --token {token}` on that machine.",
                messages.WARNING,
            )

    def get_actions(self, request: HttpRequest) -> Any:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # node_remove, one at a time, from the node's page
        return actions

    def delete_model(self, request: HttpRequest, obj: Node) -> None:
        services.node_remove(actor=admin_actor(request), name=obj.name)

    def refused_removal_url(self, object_id: str) -> str:
        return reverse("admin:fleet_node_changelist")

    @admin.action(description="Cordon: keep their replicas, place nothing new there")
    def cordon(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._cordon(request, queryset, True)

    @admin.action(description="Uncordon: place new replicas there again")
    def uncordon(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._cordon(request, queryset, False)

    def _cordon(self, request: HttpRequest, queryset: QuerySet[Node], cordoned: bool) -> None:
        done = []
        for name in queryset.values_list("name", flat=True):
            try:
                services.node_cordon(actor=admin_actor(request), name=name, cordoned=cordoned)
            except Refused as error:
                self.message_user(request, error.message, messages.ERROR)
            else:
                done.append(name)
        if done:
            word = "Cordoned" if cordoned else "Uncordoned"
            self.message_user(request, f"{word}: {', '.join(done)}.", messages.SUCCESS)

    @admin.action(description="Accept capacity: believe the memory, cores and GPUs they report")
    def accept_capacity(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        done = []
        for name in queryset.values_list("name", flat=True):
            try:
                services.node_accept_capacity(actor=admin_actor(request), name=name)
            except Refused as error:
                self.message_user(request, error.message, messages.ERROR)
            else:
                done.append(name)
        if done:
            self.message_user(
                request,
                f"Placement now counts on what they report: {', '.join(done)}.",
                messages.SUCCESS,
            )

    @admin.display(description="capacity not believed")
    def capacity_notes_shown(self, obj: Node) -> str:
        return " ".join(obj.capacity_notes()) or "-"

    @admin.display(description="state")
    def state(self, obj: Node) -> str:
        return obj.state

    @admin.display(description="memory GB (reserved / capacity)")
    def memory(self, obj: Node) -> str:
        return f"{_num(getattr(obj, 'reserved_memory', 0) or 0)} / {_num(obj.memory_gb)}"

    @admin.display(description="cores (reserved / capacity)")
    def cores_shown(self, obj: Node) -> str:
        return f"{_num(getattr(obj, 'reserved_cores', 0) or 0)} / {_num(obj.cores)}"

    @admin.display(description="replicas", ordering="active_replicas")
    def replica_count(self, obj: Node) -> int:
        return getattr(obj, "active_replicas", 0)


def _num(value: float) -> str:
    return f"{value:g}"


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin):
    list_display = [
        "model_name",
        "node",
        "profile",
        "state",
        "routable_shown",
        "port",
        "memory_gb",
        "cores",
        "created_at",
        "withdrawn_at",
    ]
    list_filter = ["state", ("withdrawn_at", admin.EmptyFieldListFilter), "node"]
    search_fields = ["model_name", "node__name", "message"]
    list_select_related = ["node"]

    @admin.display(description="routable", boolean=True)
    def routable_shown(self, obj: Replica) -> bool:
        return obj.routable


@admin.register(Lease)
class LeaseAdmin(ReadOnlyAdmin):
    list_display = ["name", "holder", "expires_at"]


@admin.register(RemovedNode)
class RemovedNodeAdmin(ReadOnlyAdmin):
    """Nodes removed in the last 30 days: their agents are told so (410) and stop their engines."""

    list_display = ["name", "removed_by", "door", "removed_at"]
    fields = ["name", "removed_by", "door", "removed_at"]  # not the token's digest
    search_fields = ["name", "removed_by"]
