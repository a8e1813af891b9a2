"""Who may use the gateway and what they used: keys, teams, their limits and policies, people's
weights in the fair queue, usage per key and day, and traffic per model and minute.

The tables keep the names they were made with (gateway_*), so that moving these models out of
the gateway moved no row (migrations/0001 to 0010 replace the gateway's own).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone
from rest_framework import serializers

from catalog.definitions import validate_name
from llmgw import bearer
from llmgw.limitdefs import LIMITS

# How stale last_used_at may get (see gateway.state.LAST_USED_SECONDS): a key used
# a thousand times a second must not cost a thousand writes a second.
LAST_USED_RESOLUTION = timedelta(seconds=60)


def validate_team_name(value: str) -> None:
    """The catalog's name rules, as a model validator (a team's name is part of URLs and commands)."""
    try:
        validate_name(value)
    except serializers.ValidationError as refusal:
        raise ValidationError(" ".join(str(d) for d in refusal.detail)) from refusal


def hash_key(secret: str) -> str:
    """What GatewayKey.key_hash keeps of a key: every bearer secret's digest (llmgw.bearer)."""
    return bearer.digest(secret)


# One field per limit (llmgw.limitdefs.LIMITS), made before LimitFields' own so they come first.
_COUNTED = {
    limit.name: models.PositiveBigIntegerField(
        null=True, blank=True, help_text=f"{limit.meaning}; blank for no limit"
    )
    for limit in LIMITS
}


class LimitFields(models.Model):
    """What a key, or a team over all its keys together, may use: each of llmgw.limitdefs.LIMITS
    (None, blank, is no limit), a weight in the fair queue and the models it may use.

    The gateway enforces them (gateway.asgi) from what it holds in memory; a change reaches it
    through the database's triggers (access.triggers), as a revocation does.
    """

    weight = models.FloatField(
        default=1.0,
        help_text=(
            "its share of a model's slots when requests queue for them (fair queueing): a weight "
            "of 2 gets twice the slots of a weight of 1"
        ),
    )

    # Last: from here on, in this class body, `models` is this field, not django.db.models.
    models = models.JSONField(
        default=list,
        blank=True,
        help_text=(
            "names or globs (fnmatch: *, ?, [...]) of the models and adapters it may use; "
            "empty for every model"
        ),
    )

    class Meta:
        abstract = True


for _name, _field in _COUNTED.items():
    LimitFields.add_to_class(_name, _field)


class Team(LimitFields):
    """Users who share a fleet's limits: a team's limits count all its keys together."""

    name = models.CharField(max_length=100, unique=True, validators=[validate_team_name])
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL, related_name="llmgw_teams", blank=True
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "gateway_team"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class GatewayKey(LimitFields):
    """One application's key to the gateway.

    Only the hash and a short prefix are kept: the key itself is shown once,
    when it is created. A revoked key stays listed (who had it, when it was
    last used) but opens nothing.
    """

    name = models.CharField(max_length=100, help_text="what the key is for, in your words")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="gateway_keys"
    )
    prefix = models.CharField(
        max_length=20, help_text="the key's first characters, to tell keys apart"
    )
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    last_used_at = models.DateTimeField(
        null=True, blank=True, help_text=f"to within {LAST_USED_RESOLUTION.seconds}s"
    )
    team = models.ForeignKey(
        Team,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="keys",
        help_text="whose limits it also counts against, over all the team's keys together",
    )
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="after this the key opens nothing; blank for never"
    )
    # Set by the database itself (access.triggers), whatever wrote the row: when the key was
    # added, its hash, revocation, limits, team or expiry changed, or its owner was deactivated or reactivated. Each
    # gateway process reads only the keys changed since its last read, by this index, rather
    # than every key on every change (1.2 M keys took 5.9 s a read).
    changed_at = models.DateTimeField(default=timezone.now, db_index=True, editable=False)
    # What staff set on this key: the most its owner may set each of those settings to
    # (access.policies). Counters, weight and models by their names, the expiry as
    # "expires_at" in ISO 8601. The gateway does not read it: a ceiling is held when a limit is
    # written, so the key's own figures are always within it.
    ceilings = models.JSONField(
        default=dict,
        blank=True,
        help_text="what staff set on the key: its owner may lower these and never raise them",
    )

    class Meta:
        db_table = "gateway_gatewaykey"
        ordering = ["-created_at", "-id"]
        verbose_name = "gateway key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    def state(self) -> str:
        return "revoked" if self.revoked_at else "active"


class KeyPolicy(models.Model):
    """What new keys get, and the most their owners may set: each limit's default and ceiling.

    Of one team (for its members' keys in it), of one user (for their keys in no team), or the
    default (for everyone else's keys in no team); access.policies.policy_for says which a key
    is under. Only staff set them (access.services.policy_set), and a ceiling lowered lowers the
    keys under it that are above it, so a key's figures are always within what is in force.
    """

    KINDS = [("default", "every user's keys in no team"), ("team", "a team"), ("user", "a user")]

    kind = models.CharField(max_length=10, choices=KINDS)
    team = models.OneToOneField(
        Team, null=True, blank=True, on_delete=models.CASCADE, related_name="key_policy"
    )
    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="llmgw_key_policy",
    )
    # By counter name (access.services.COUNTERS); a name missing has no default or ceiling.
    defaults = models.JSONField(
        default=dict, blank=True, help_text="what a new key gets of each limit not given"
    )
    ceilings = models.JSONField(
        default=dict, blank=True, help_text="the most a key's owner may set each limit to"
    )
    changed_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "gateway_keypolicy"
        verbose_name = "key policy"
        verbose_name_plural = "key policies"
        constraints = [
            models.CheckConstraint(
                condition=(
                    models.Q(kind="default", team__isnull=True, user__isnull=True)
                    | models.Q(kind="team", team__isnull=False, user__isnull=True)
                    | models.Q(kind="user", team__isnull=True, user__isnull=False)
                ),
                name="key_policy_one_scope",
            ),
            models.UniqueConstraint(
                fields=["kind"], condition=models.Q(kind="default"), name="key_policy_one_default"
            ),
        ]

    def __str__(self) -> str:
        return self.scope

    @property
    def scope(self) -> str:
        """How the API and the CLI name it: default, team:NAME or user:NAME."""
        if self.team is not None:
            return f"team:{self.team.name}"
        if self.user is not None:
            return f"user:{self.user.get_username()}"
        return "default"


class UserWeight(models.Model):
    """A person's weight in the fair queue (gateway.fairqueue.share): beside the other people
    with no team, and within their team's share beside its other people. A person without one
    weighs 1 within a team, and their heaviest key in use outside one. Only staff set it
    (access.services.user_weight_set)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="llmgw_weight"
    )
    weight = models.FloatField(
        help_text=(
            "their share of a model's slots when requests queue for them: a person of weight 2 "
            "gets twice the slots of one of weight 1"
        )
    )

    class Meta:
        db_table = "gateway_userweight"

    def __str__(self) -> str:
        return f"{self.user} ({self.weight:g})"


class DeletedGatewayKey(models.Model):
    """The hash of a gateway key whose row was deleted (its owner was deleted: keys go with them).

    Written by a database trigger, so that a gateway process reading only what changed also
    learns what is gone, and stops honouring it within a refresh. Rows older than
    gateway.state.DELETED_KEEP are removed by the gateway processes themselves; a process that
    has not read for that long reads every key again instead. So the table holds at most one
    DELETED_KEEP's worth of deleted keys.
    """

    key_hash = models.CharField(max_length=64)
    deleted_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        db_table = "gateway_deletedgatewaykey"

    def __str__(self) -> str:
        return f"gateway key {self.key_hash[:8]}… deleted at {self.deleted_at:%Y-%m-%d %H:%M}"


class RoutingVersion(models.Model):
    """One row that the database itself bumps whenever something the gateway routes by changes.

    Triggers (see migration 0002) on models, replicas, nodes and gateway keys bump
    it on SQLite, and send a `llmgw_routing` notification on PostgreSQL (sent when
    the change commits, and without the row lock a shared counter would take). The
    gateway's processes keep what they route by in memory and read it again when
    this moves or the notification comes; no writer can forget to say so, because
    none has to.
    """

    version = models.BigIntegerField(default=0)

    class Meta:
        db_table = "gateway_routingversion"

    def __str__(self) -> str:
        return f"routing version {self.version}"


class TrafficMinute(models.Model):
    """What one gateway process answered for one model in one minute (or, folded, one hour).

    Each process writes only its own rows, with the absolute totals it holds in memory, so
    writers never race on a counter; a chart sums the writers of each minute. Minutes older
    than a day are folded into hours (writer "") and hours are kept for TRAFFIC_KEEP_DAYS, so
    the table stays bounded: about 1,440 + 24 x 8 rows per model and writer.
    """

    model = models.CharField(max_length=200)
    # The weights of the replica that answered (fleet.specs.weights_revision): a canary
    # update compares its two revisions by it. Blank when no replica answered, and in hours.
    revision = models.CharField(max_length=40, blank=True, default="")
    start = models.DateTimeField(help_text="the minute (or hour) the figures are for, UTC")
    span = models.PositiveIntegerField(default=60, help_text="seconds: 60, or 3600 once folded")
    writer = models.CharField(max_length=40, blank=True)
    requests = models.PositiveIntegerField(default=0)
    client_errors = models.PositiveIntegerField(default=0, help_text="answers 400-499")
    server_errors = models.PositiveIntegerField(default=0, help_text="answers 500-599")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    seconds = models.FloatField(default=0, help_text="time spent answering, summed")
    latency_buckets = models.JSONField(
        default=list, help_text="how many answers took at most each of LATENCY_BOUNDS seconds"
    )
    # The fair queue (gateway.fairqueue), counted in the minute a wait ended, under the model
    # whose slots were busy, in the row of revision "" (no replica had answered yet). A request
    # that found a slot free and nobody waiting is not counted here.
    queued = models.PositiveIntegerField(
        default=0,
        db_default=0,
        help_text="requests that waited in the gateway for a free slot (then served, timed out "
        "or hung up)",
    )
    queue_seconds = models.FloatField(
        default=0, db_default=0, help_text="their time in the queue, summed"
    )
    queue_seconds_max = models.FloatField(
        default=0, db_default=0, help_text="the longest of those waits"
    )
    queue_timeouts = models.PositiveIntegerField(
        default=0, db_default=0, help_text="waits that ran out (LLMGW_QUEUE_TIMEOUT), answered 503"
    )
    queue_full = models.PositiveIntegerField(
        default=0,
        db_default=0,
        help_text="requests refused at once because the queue was full (LLMGW_QUEUE_MAX), "
        "answered 429",
    )
    # The slowest answer of the row, with its request's ID (core.requestid: X-Request-ID, in
    # the gateway's log lines and as llmgw.request_id in its traces), so that a slow minute on
    # a chart leads to one request to follow. Of several rows, the slowest of theirs.
    slowest_seconds = models.FloatField(
        default=0, db_default=0, help_text="the longest time spent answering one request"
    )
    slowest_request = models.CharField(
        max_length=64,
        blank=True,
        default="",
        db_default="",
        help_text="that request's ID (X-Request-ID)",
    )

    class Meta:
        db_table = "gateway_trafficminute"
        constraints = [
            models.UniqueConstraint(
                fields=["model", "revision", "start", "span", "writer"],
                name="traffic_minute_once",
            )
        ]
        indexes = [models.Index(fields=["start", "model"])]

    def __str__(self) -> str:
        return f"{self.model} at {self.start:%Y-%m-%d %H:%M}: {self.requests} requests"


class KeyUsageDay(models.Model):
    """Requests and tokens of one gateway key for one model on one day (UTC), per writer."""

    key = models.ForeignKey(GatewayKey, on_delete=models.CASCADE, related_name="usage")
    model = models.CharField(max_length=200)
    day = models.DateField()
    writer = models.CharField(max_length=40, blank=True)
    requests = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "gateway_keyusageday"
        constraints = [
            models.UniqueConstraint(
                fields=["key", "model", "day", "writer"], name="key_usage_day_once"
            )
        ]
        indexes = [models.Index(fields=["day"])]

    def __str__(self) -> str:
        return f"key {self.key_id}, {self.model} on {self.day}: {self.requests} requests"


# The roles (access.roles): admin is staff (User.is_staff), member is Team.members; these rows
# hold the rest, and mark what the identity provider's groups gave (access.roles.apply_groups).
ADMIN, TEAM_ADMIN, MEMBER, VIEWER = "admin", "team-admin", "member", "viewer"
ROLES = [
    (ADMIN, "admin: staff, over everything"),
    (TEAM_ADMIN, "team admin: a team's members, keys and usage"),
    (MEMBER, "member: makes keys under the team's policy"),
    (VIEWER, "viewer: reads models and usage, makes no keys"),
]
TEAM_ROLES = (TEAM_ADMIN, MEMBER)
HAND, GROUPS = "hand", "groups"


def team_when_needed(name: str) -> models.CheckConstraint:
    """A team for team admin and member, none for admin and viewer."""
    return models.CheckConstraint(
        condition=(
            models.Q(role__in=TEAM_ROLES, team__isnull=False)
            | models.Q(role__in=(ADMIN, VIEWER), team__isnull=True)
        ),
        name=name,
    )


SOURCES = [(HAND, "given by hand (staff)"), (GROUPS, "from the identity provider's groups")]


class TeamRole(models.Model):
    """One role of one user: team admin of a team, or viewer (of everything, no team).

    Rows of source "groups" were made by the group mapping at a sign-in and are taken away by it
    when the groups no longer say so; it also marks with them the memberships (member) and the
    staff flag (admin) it gave, so that it never takes away what staff gave by hand.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="llmgw_roles"
    )
    role = models.CharField(max_length=20, choices=ROLES)
    team = models.ForeignKey(
        Team,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="roles",
        help_text="the team a team admin's or member's role is in; blank for viewer and admin",
    )
    source = models.CharField(max_length=10, choices=SOURCES, default=HAND)
    granted_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "gateway_teamrole"
        ordering = ["user__username", "role", "team__name"]
        verbose_name = "role"
        constraints = [
            team_when_needed("team_role_team_when_needed"),
            models.UniqueConstraint(
                fields=["user", "role", "team"],
                condition=models.Q(team__isnull=False),
                name="team_role_once_in_a_team",
            ),
            models.UniqueConstraint(
                fields=["user", "role"],
                condition=models.Q(team__isnull=True),
                name="team_role_once_without_a_team",
            ),
        ]

    def __str__(self) -> str:
        where = f" of {self.team.name}" if self.team is not None else ""
        return f"{self.user} is {self.role}{where} ({self.source})"


class GroupMapping(models.Model):
    """One group of the identity provider and the role it gives in llmgw, beside the setting
    LLMGW_OIDC_GROUP_MAP (both apply; access.roles.apply_groups reads them at each sign-in)."""

    group = models.CharField(max_length=200, help_text="the group's name as the provider sends it")
    role = models.CharField(max_length=20, choices=ROLES)
    team = models.ForeignKey(
        Team,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="group_mappings",
        help_text="for member and team admin: the team; blank for admin and viewer",
    )

    class Meta:
        db_table = "gateway_groupmapping"
        ordering = ["group", "role"]
        verbose_name = "group mapping"
        constraints = [
            team_when_needed("group_mapping_team_when_needed"),
        ]

    def __str__(self) -> str:
        where = f":{self.team.name}" if self.team is not None else ""
        return f"{self.group}={self.role}{where}"
