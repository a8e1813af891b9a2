"""Gateway keys and teams in the admin, changed through the same services as every other door.

Keys are made by their owners (the key is shown once, to whoever creates it), so the admin
does not add them; it changes a key's limits, team and expiry (what it sets becomes the key's
ceilings: the admin is staff's), and revokes keys. Teams are added, limited, given members and
removed here, given team admins, and key policies set and removed; roles given by hand (viewer)
and the identity provider's groups mapped to roles (access.roles) are added and removed here.
The admin is staff's door: team admins use the console, the API and the CLI. As in catalog.admin, the services are called
from the form's clean(), so that a refusal (a key limit above its team's, an unknown user) is
shown on the form rather than becoming a server error, and the audit says "admin" and who.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import widgets
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse

from core.actor import Actor
from core.admin import RemovedThroughServiceAdmin, RequestFormAdmin, admin_actor
from core.refusals import Refused
from llmgw.limitdefs import Limit

from . import policies, roles, services
from .forms import with_limit_fields
from .models import (
    TEAM_ADMIN,
    VIEWER,
    GatewayKey,
    GroupMapping,
    KeyPolicy,
    Team,
    TeamRole,
    UserWeight,
)


def _counter_field(label: str, help_text: str, blank: str = "no limit") -> forms.IntegerField:
    return forms.IntegerField(
        label=label,
        required=False,
        min_value=0,
        max_value=services.MAX_COUNTER,
        help_text=f"{help_text}; blank or 0 for {blank}",
    )


@with_limit_fields(lambda limit: {limit.name: _counter_field(limit.label, limit.meaning)})
class LimitsForm(forms.ModelForm):
    """The limits a key and a team share, as plain fields: the services write them, not the form."""

    models = forms.CharField(
        label="Models",
        required=False,
        help_text="names or globs of the models and adapters it may use, comma-separated "
        "(llama-*, qwen:support); blank for every model",
    )
    weight = forms.FloatField(
        label="Weight",
        initial=1.0,
        help_text="its share of a model's slots when requests queue for them (default 1)",
    )

    SETTINGS = [*services.COUNTERS, "models", "weight"]
    # Set per request by the ModelAdmin's get_form: the services need to know who acts.
    request: HttpRequest

    class Meta:
        fields: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk and not self.is_bound:
            for name, value in services.limits_of(self.instance).items():
                self.initial[name] = ", ".join(value) if name == "models" else value

    def changes(self) -> dict[str, Any]:
        """The settings the form changed, as the services take them."""
        return {
            name: self.cleaned_data[name] for name in self.SETTINGS if name in self.changed_data
        }

    def clean(self) -> dict[str, Any] | None:
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            # A refusal of a later step undoes the earlier ones: nothing half-written.
            with transaction.atomic():
                self.instance = self.apply(admin_actor(self.request))
        except Refused as error:
            self.add_error(None, error.message)
            for problem in error.problems:
                field = problem.field if problem.field in self.fields else None
                self.add_error(field, str(problem))
        return data

    def apply(self, actor: Actor) -> Any:
        raise NotImplementedError


class TeamForm(LimitsForm):
    name = forms.CharField(
        max_length=100, help_text="letters, digits, '.', '_', '-' and ':', as a model's name"
    )
    members = forms.ModelMultipleChoiceField(
        queryset=get_user_model().objects.order_by("username"),
        required=False,
        widget=widgets.FilteredSelectMultiple("members", is_stacked=False),
    )
    admins = forms.ModelMultipleChoiceField(
        label="Team admins",
        queryset=get_user_model().objects.order_by("username"),
        required=False,
        widget=widgets.FilteredSelectMultiple("team admins", is_stacked=False),
        help_text="they change the team's members and manage its keys, within what staff set; "
        "a team admin is a member too",
    )

    class Meta:
        model = Team
        fields: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            # A team's name is part of URLs and commands: it is not changed in place.
            self.fields["name"].disabled = True
            if not self.is_bound:
                self.initial["name"] = self.instance.name
                self.initial["members"] = list(self.instance.members.all())
                self.initial["admins"] = list(
                    get_user_model().objects.filter(
                        llmgw_roles__team=self.instance, llmgw_roles__role=TEAM_ADMIN
                    )
                )

    def apply(self, actor: Actor) -> Team:
        members = [u.get_username() for u in self.cleaned_data["members"]]
        admins = {u.get_username() for u in self.cleaned_data["admins"]}
        if self.instance.pk is None:
            team = services.team_add(
                actor=actor,
                name=self.cleaned_data["name"],
                limits=self.changes(),
                members=members,
            )
            had: set[str] = set(members)
            admins_had: set[str] = set()
        else:
            team = services.team_set_limits(
                actor=actor, name=self.instance.name, changes=self.changes()
            )
            had = {u.get_username() for u in self.instance.members.all()}
            admins_had = set(roles.admins_of(team))
        if set(members) == had and admins == admins_had:
            return team
        return services.team_members(
            actor=actor,
            name=team.name,
            add=sorted(set(members) - had),
            remove=sorted(had - set(members) - admins),
            add_admins=sorted(admins - admins_had),
            remove_admins=sorted(admins_had - admins),
        )


class KeyForm(LimitsForm):
    team = forms.ModelChoiceField(
        queryset=Team.objects.order_by("name"),
        required=False,
        help_text="whose limits it also counts against, over all the team's keys together",
    )
    expires_at = forms.SplitDateTimeField(
        label="Expires at",
        required=False,
        help_text="after this (UTC) the key opens nothing; blank for never",
        widget=widgets.AdminSplitDateTime,
    )

    SETTINGS = [*LimitsForm.SETTINGS, "team", "expires_at"]

    class Meta:
        model = GatewayKey
        fields: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk and not self.is_bound:
            self.initial["team"] = self.instance.team
            self.initial["expires_at"] = self.instance.expires_at

    def changes(self) -> dict[str, Any]:
        changes = super().changes()
        if "team" in changes:
            changes["team"] = changes["team"].name if changes["team"] else None
        if "expires_at" in changes:
            changes["expires"] = changes.pop("expires_at")
        return changes

    def apply(self, actor: Actor) -> GatewayKey:
        return services.key_set_limits(actor=actor, key_id=self.instance.pk, changes=self.changes())


class ThroughServicesAdmin(RequestFormAdmin):
    """The form made the change (its clean()); saving it again would bypass the services."""

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """Nothing to save: the form's clean() made the change through the services."""

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """Nothing related is edited here."""


@admin.register(Team)
class TeamAdmin(RemovedThroughServiceAdmin, ThroughServicesAdmin):
    form = TeamForm
    list_display = ["name", "member_count", "admins_shown", "limits_shown", "created_at"]
    search_fields = ["name", "members__username"]
    fieldsets = [
        (None, {"fields": ["name", "members", "admins"]}),
        (
            "Limits, over all the team's keys together",
            {"fields": [*services.COUNTERS, "models", "weight"]},
        ),
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Team]:
        return super().get_queryset(request).prefetch_related("members")

    @admin.display(description="members")
    def member_count(self, obj: Team) -> int:
        return len(obj.members.all())

    @admin.display(description="limits")
    def limits_shown(self, obj: Team) -> str:
        return limits_text(obj)

    @admin.display(description="team admins")
    def admins_shown(self, obj: Team) -> str:
        return ", ".join(roles.admins_of(obj)) or "none"

    def delete_model(self, request: HttpRequest, obj: Team) -> None:
        keys = services.team_remove(actor=admin_actor(request), name=obj.name)
        self.message_user(request, f"Its {keys} key(s) stay, without the team's limits.")

    def refused_removal_url(self, object_id: str) -> str:
        return reverse("admin:access_team_changelist")


def limits_text(holder: GatewayKey | Team) -> str:
    limits = services.limits_of(holder)
    parts = [f"{name} {limits[name]:,}" for name in services.COUNTERS if limits[name] is not None]
    if limits["models"]:
        parts.append("models " + ", ".join(limits["models"]))
    if limits["weight"] != 1:
        parts.append(f"weight {limits['weight']:g}")
    return "; ".join(parts) or "none"


@admin.register(GatewayKey)
class GatewayKeyAdmin(ThroughServicesAdmin):
    form = KeyForm
    list_display = [
        "prefix",
        "name",
        "owner",
        "team",
        "limits_shown",
        "expires_at",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter), "team"]
    search_fields = ["name", "prefix", "owner__username"]
    list_select_related = ["owner", "team"]
    readonly_fields = [
        "name",
        "owner",
        "prefix",
        "created_at",
        "last_used_at",
        "revoked_at",
        "revoked_by",
        "ceilings_shown",
        "policy_shown",
    ]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "name",
                    "owner",
                    "prefix",
                    "created_at",
                    "last_used_at",
                    "revoked_at",
                    "revoked_by",
                ]
            },
        ),
        (
            "Limits, team and expiry",
            {
                "fields": ["team", "expires_at", *services.COUNTERS, "models", "weight"],
                "description": "What you set here is the key's ceiling: its owner may lower it "
                "and never raise it; lifting a limit leaves the key to its key policy's.",
            },
        ),
        ("Ceilings its owner is held to", {"fields": ["ceilings_shown", "policy_shown"]}),
    ]
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a key is shown once, to whoever creates it: the owner, in the console or CLI

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # revoked keys stay, so that who had which key is still known

    @admin.display(description="limits")
    def limits_shown(self, obj: GatewayKey) -> str:
        return limits_text(obj)

    @admin.display(description="ceilings")
    def ceilings_shown(self, obj: GatewayKey) -> str:
        policy = policies.policy_for(obj.team, obj.owner)
        found = policies.ceilings_in_force(obj, policy)
        return "; ".join(
            f"{name} {found[name].figure} ({found[name].source})" for name in found
        ) or ("none")

    @admin.display(description="key policy")
    def policy_shown(self, obj: GatewayKey) -> str:
        policy = policies.policy_for(obj.team, obj.owner)
        return policy.scope if policy is not None else "none"

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[GatewayKey]) -> None:
        actor = admin_actor(request)
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


# -- key policies -------------------------------------------------------------------------------


def _policy_field(label: str, help_text: str) -> forms.IntegerField:
    return _counter_field(label, help_text, blank="none")


DEFAULT_HELP = "what a new key gets when not given"
CEILING_HELP = "the most an owner may set it to (keys above it are lowered to it)"


def _policy_fields(limit: Limit) -> dict[str, forms.Field]:
    words = limit.label[0].lower() + limit.label[1:]
    return {
        f"default_{limit.name}": _policy_field(f"Default {words}", DEFAULT_HELP),
        f"max_{limit.name}": _policy_field(f"Ceiling of {words}", CEILING_HELP),
    }


@with_limit_fields(_policy_fields, first=False)
class KeyPolicyForm(forms.ModelForm):
    """A key policy's scope and each limit's default and ceiling; the services write them."""

    kind = forms.ChoiceField(
        label="Whose keys",
        choices=KeyPolicy.KINDS,
        help_text="a team's keys, one user's keys in no team, or everyone else's keys in no team",
    )
    team = forms.ModelChoiceField(
        queryset=Team.objects.order_by("name"), required=False, help_text="for a team's policy"
    )
    user = forms.ModelChoiceField(
        queryset=get_user_model().objects.order_by("username"),
        required=False,
        help_text="for a user's policy",
    )

    PARTS = (("defaults", "default"), ("ceilings", "max"))
    # Set per request by the ModelAdmin's get_form: the services need to know who acts.
    request: HttpRequest
    lowered = 0

    class Meta:
        model = KeyPolicy
        fields: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            # A policy's scope is what it is: another scope is another policy.
            for name in ("kind", "team", "user"):
                self.fields[name].disabled = True
            # Also when bound: what the form changed is what differs from these.
            for part, prefix in self.PARTS:
                for name in services.COUNTERS:
                    self.initial[f"{prefix}_{name}"] = getattr(self.instance, part).get(name)

    def scope(self) -> str:
        data = self.cleaned_data
        if data["kind"] == "team":
            if data["team"] is None:
                raise Refused("Choose the team whose keys the policy holds.")
            return f"team:{data['team'].name}"
        if data["kind"] == "user":
            if data["user"] is None:
                raise Refused("Choose the user whose keys the policy holds.")
            return f"user:{data['user'].get_username()}"
        return "default"

    def parts(self) -> dict[str, dict[str, Any]]:
        """The figures the form changed (those given, for a new policy), as the service takes
        them: blank or 0 takes a default or ceiling away."""
        new = self.instance.pk is None
        found: dict[str, dict[str, Any]] = {}
        for part, prefix in self.PARTS:
            found[part] = {}
            for name in services.COUNTERS:
                field = f"{prefix}_{name}"
                value = self.cleaned_data.get(field)
                if field in self.changed_data and (value is not None or not new):
                    found[part][name] = value
        return found

    def clean(self) -> dict[str, Any] | None:
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            with transaction.atomic():
                self.instance, self.lowered = services.policy_set(
                    actor=admin_actor(self.request), scope=self.scope(), **self.parts()
                )
        except Refused as error:
            self.add_error(None, error.message)
            for problem in error.problems:
                part, _, name = problem.field.partition(".")
                field = f"{dict(self.PARTS).get(part, part)}_{name}"
                self.add_error(field if field in self.fields else None, problem.message)
        return data


@admin.register(KeyPolicy)
class KeyPolicyAdmin(RemovedThroughServiceAdmin, ThroughServicesAdmin):
    form = KeyPolicyForm
    list_display = ["__str__", "defaults_shown", "ceilings_shown", "changed_at"]
    fieldsets = [
        (None, {"fields": ["kind", "team", "user"]}),
        (
            "Defaults and ceilings of each key's limits",
            {
                "fields": [
                    f"{prefix}_{name}"
                    for name in services.COUNTERS
                    for prefix in ("default", "max")
                ]
            },
        ),
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[KeyPolicy]:
        return super().get_queryset(request).select_related("team", "user")

    @admin.display(description="defaults")
    def defaults_shown(self, obj: KeyPolicy) -> str:
        return _figures(obj.defaults)

    @admin.display(description="ceilings")
    def ceilings_shown(self, obj: KeyPolicy) -> str:
        return _figures(obj.ceilings)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """The form's clean() made the change; this says what it did to the keys under it."""
        if form.lowered:
            self.message_user(request, f"{form.lowered} key(s) above a ceiling were lowered to it.")

    def delete_model(self, request: HttpRequest, obj: KeyPolicy) -> None:
        services.policy_remove(actor=admin_actor(request), scope=obj.scope)
        self.message_user(request, "Its keys keep their limits.")

    def refused_removal_url(self, object_id: str) -> str:
        return reverse("admin:access_keypolicy_changelist")


class UserWeightForm(forms.ModelForm):
    """A person's weight in the fair queue; the service writes it (and audits it)."""

    request: HttpRequest  # set per request by RequestFormAdmin.get_form

    class Meta:
        model = UserWeight
        fields = ["user", "weight"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields["user"].disabled = True  # another person's is another row

    def clean(self) -> dict[str, Any] | None:
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            with transaction.atomic():
                row = services.user_weight_set(
                    actor=admin_actor(self.request),
                    username=data["user"].get_username(),
                    weight=data["weight"],
                )
            if row is not None:
                self.instance = row
        except Refused as error:
            self.add_error(None, error.message)
            for problem in error.problems:
                self.add_error(problem.field if problem.field in self.fields else None,
                               problem.message)  # fmt: skip
        return data


@admin.register(UserWeight)
class UserWeightAdmin(RemovedThroughServiceAdmin, ThroughServicesAdmin):
    form = UserWeightForm
    list_display = ["user", "weight"]
    search_fields = ["user__username"]

    def delete_model(self, request: HttpRequest, obj: UserWeight) -> None:
        services.user_weight_set(
            actor=admin_actor(request), username=obj.user.get_username(), weight=None
        )

    def refused_removal_url(self, object_id: str) -> str:
        return reverse("admin:access_userweight_changelist")


def _figures(figures: dict[str, Any]) -> str:
    return ", ".join(
        f"{name} {figures[name]:,}" for name in services.COUNTERS if name in figures
    ) or ("none")


# -- roles given by hand, and the identity provider's groups ------------------------------------


class GivenForm(forms.ModelForm):
    """A row a service makes (give()) from the form's clean(): its refusal is shown on the form,
    and the row it made is the form's instance (so the model's own checks find it, not a twin)."""

    request: HttpRequest  # set per request by RequestFormAdmin.get_form

    def give(self, actor: Actor, data: dict[str, Any]) -> Any:
        raise NotImplementedError

    def clean(self) -> dict[str, Any] | None:
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            with transaction.atomic():
                self.instance = self.give(admin_actor(self.request), data)
        except Refused as error:
            self.add_error(None, error.message)
        return data


class TeamRoleForm(GivenForm):
    """A role given by hand: viewer (no team) or team admin of a team; the services write it."""

    role = forms.ChoiceField(
        choices=[
            (VIEWER, "viewer: reads models and usage, makes no keys"),
            (TEAM_ADMIN, "team admin: the team's members, keys and usage"),
        ],
        help_text="member is given by adding them to a team, admin by staff status",
    )

    class Meta:
        model = TeamRole
        fields = ["user", "role", "team"]

    def give(self, actor: Actor, data: dict[str, Any]) -> TeamRole:
        return services.role_give(
            actor=actor,
            username=data["user"].get_username(),
            role=data["role"],
            team=data["team"].name if data.get("team") else None,
        )


@admin.register(TeamRole)
class TeamRoleAdmin(RemovedThroughServiceAdmin, ThroughServicesAdmin):
    """Roles: given here by hand, or by the group mapping at a sign-in (source "groups"). A role
    is given or taken away, not changed: another role is another row."""

    form = TeamRoleForm
    list_display = ["user", "role", "team", "source", "granted_at"]
    list_filter = ["role", "source", "team"]
    search_fields = ["user__username", "team__name"]
    list_select_related = ["user", "team"]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and super().has_change_permission(request, obj)

    def delete_model(self, request: HttpRequest, obj: TeamRole) -> None:
        services.role_take(
            actor=admin_actor(request),
            username=obj.user.get_username(),
            role=obj.role,
            team=obj.team.name if obj.team else None,
        )

    def refused_removal_url(self, object_id: str) -> str:
        return reverse("admin:access_teamrole_changelist")


class GroupMappingForm(GivenForm):
    """One group of the identity provider and its role; the services write it (and audit it)."""

    class Meta:
        model = GroupMapping
        fields = ["group", "role", "team"]

    def give(self, actor: Actor, data: dict[str, Any]) -> GroupMapping:
        return services.group_mapping_add(
            actor=actor,
            group=data["group"],
            role=data["role"],
            team=data["team"].name if data.get("team") else None,
        )


@admin.register(GroupMapping)
class GroupMappingAdmin(RemovedThroughServiceAdmin, ThroughServicesAdmin):
    """The identity provider's groups and the roles they give at each sign-in, beside the
    setting LLMGW_OIDC_GROUP_MAP (both apply)."""

    form = GroupMappingForm
    list_display = ["group", "role", "team"]
    search_fields = ["group", "team__name"]
    list_select_related = ["team"]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and super().has_change_permission(request, obj)

    def delete_model(self, request: HttpRequest, obj: GroupMapping) -> None:
        services.group_mapping_remove(actor=admin_actor(request), mapping_id=obj.pk)

    def refused_removal_url(self, object_id: str) -> str:
        return reverse("admin:access_groupmapping_changelist")
