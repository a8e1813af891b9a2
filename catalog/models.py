"""The catalog: models people serve, and the audit trail of every change to them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q

from core.durations import format_duration
from llmgw.engines import DEFAULT_ENGINE

CLASS_CHOICES = [
    ("critical", "critical"),
    ("standard", "standard"),
    ("opportunistic", "opportunistic"),
]


# -- scaling in force: the rules, for a row or for its min and max alone ------------------------
# The gateway reads min and max without loading models, and the console filters in SQL: they
# use these, so that "on demand" and "parked" mean one thing everywhere.


def max_in_force(min_replicas: int, max_replicas: int | None) -> int:
    """max_replicas left out follows min_replicas."""
    return min_replicas if max_replicas is None else max_replicas


def is_on_demand(min_replicas: int, max_replicas: int | None) -> bool:
    """min 0 and a max above it: started when asked for, stopped when idle."""
    return min_replicas == 0 and max_in_force(min_replicas, max_replicas) > 0


def is_parked(min_replicas: int, max_replicas: int | None) -> bool:
    """min 0 max 0: kept in the catalog, deliberately not running."""
    return min_replicas == 0 and max_in_force(min_replicas, max_replicas) == 0


# The same two rules in SQL (max_replicas null follows min_replicas, 0 here).
ON_DEMAND = Q(min_replicas=0, max_replicas__gt=0)
PARKED = Q(min_replicas=0) & (Q(max_replicas=0) | Q(max_replicas__isnull=True))


# A canary's states while its replica serves a share of the requests, or is on its way to.
CANARY_ACTIVE = ("waiting", "watching")


@dataclass(frozen=True)
class CanaryRouting:
    """What routing and the reconciler need of a canary under way."""

    revision: str  # the new weights' revision (fleet.specs.weights_revision)
    percent: int  # of the model's requests the canary replica gets


def canary_routing(canary: Any) -> CanaryRouting | None:
    """The canary in force from a model's `canary` value; None when none runs."""
    if not isinstance(canary, dict) or canary.get("state") not in CANARY_ACTIVE:
        return None
    revision, percent = canary.get("revision"), canary.get("percent")
    if not isinstance(revision, str) or not isinstance(percent, int):
        return None
    return CanaryRouting(revision=revision, percent=percent)


# -- a model's vision projector: a file of the weights' repository, at the weights' revision ----


def repository_folder(source: str) -> str:
    """The folder of the weights' repository at their revision, as a URL ending in '/': for a
    mirror URL (LLMGW_PUBLIC_URL/mirror/ORG/REPO/COMMIT/PATH) the commit's folder, so that a
    weights file in a subfolder still finds files named from the repository's top; for any
    other URL the weights' own folder."""
    prefix = f"{settings.LLMGW_PUBLIC_URL}/mirror/"
    if source.startswith(prefix):
        parts = source[len(prefix) :].split("/")
        if len(parts) >= 4:
            return prefix + "/".join(parts[:3]) + "/"
    return source.split("?", 1)[0].rsplit("/", 1)[0] + "/"


def projector_source(source: str, mmproj: str) -> str:
    """Where the projector `mmproj` of the weights at `source` is: beside them, at the same
    revision, so that an update or a rollback of the source moves the projector with it."""
    return repository_folder(source) + mmproj


@dataclass(frozen=True)
class Projector:
    """A file of the weights' repository at the weights' revision, loaded with them: the vision
    projector a model's replicas are started with, or one of a snapshot's other files."""

    path: str  # in the repository, as the definition names it
    source: str  # its URL, at the weights' revision
    sha256: str | None  # from the registry origin, when the model has one
    size: int | None

    def spec(self) -> dict[str, Any]:
        """As a replica's spec holds it (fleet.specs.replica_spec)."""
        return {"path": self.path, "source": self.source, "sha256": self.sha256}


def projector_of(source: str, mmproj: str, origin: dict[str, Any] | None) -> Projector | None:
    """The projector of weights at `source` (and, from the registry, `origin`), or None for
    a model without one."""
    return repository_file(source, mmproj, origin) if mmproj else None


def repository_file(source: str, path: str, origin: dict[str, Any] | None) -> Projector:
    """The file `path` of the repository of weights at `source`, at their revision. Its sha256
    and size are the origin's record of the file, when it has one at that commit."""
    entry = next(
        (f for f in (origin or {}).get("files", []) if f.get("path") == path),
        None,
    )
    return Projector(
        path=path,
        source=projector_source(source, path),
        sha256=(entry or {}).get("sha256") or None,
        size=(entry or {}).get("size"),
    )


def engine_of(engine: str) -> str:
    """The engine a model's `engine` field names: "" is the default one."""
    return engine or DEFAULT_ENGINE


def repository_file_sources(source: str, mmproj: str, files: list[str] | None) -> list[str]:
    """The URLs of a revision's files besides its weights: the projector's, then the other
    files', each at the revision of `source` (what the mirror keeps with those weights)."""
    paths = ([mmproj] if mmproj else []) + list(files or [])
    return [projector_source(source, path) for path in paths]


class Model(models.Model):
    """One model in the catalog: where its weights are, how many replicas, what each reserves.

    Profiles and adapters are kept as JSON lists on the row: they are always
    read and written with their model, validated as part of its definition, and
    a definition round-trips through server.yaml unchanged.
    """

    name = models.CharField(max_length=100, unique=True)
    source = models.CharField(max_length=2000)
    sha256 = models.CharField(max_length=64, blank=True, default="")
    description = models.TextField(blank=True, default="")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="owned_models",
    )
    model_class = models.CharField(
        "class", max_length=20, choices=CLASS_CHOICES, blank=True, default=""
    )
    min_replicas = models.PositiveIntegerField(default=1)
    max_replicas = models.PositiveIntegerField(null=True, blank=True)
    idle_timeout = models.PositiveIntegerField(
        default=0, help_text="seconds; 0 takes the cluster default"
    )
    fallbacks = models.JSONField(default=list, blank=True)
    context_length = models.PositiveIntegerField(null=True, blank=True)
    # Beside source: the vision projector's path in the weights' repository ("" for none). Its
    # URL and revision follow the source's (projector_of), so it moves with every update and
    # rollback of the weights; its sha256 is in origin's files with theirs.
    mmproj = models.CharField(
        max_length=500,
        blank=True,
        default="",
        help_text=(
            "the vision projector's file in the weights' repository, like "
            "mmproj-model-f16.gguf; empty for a model without images"
        ),
    )
    # The engine its replicas run (llmgw.engines; "" for the default one, so that a model defined
    # before there were several reads back as it was written). Each fact of that engine (the
    # weights it reads, the endpoints it serves, its memory) is asked of its backend.
    engine = models.CharField(
        max_length=40,
        blank=True,
        default="",
        help_text="the engine its replicas run (docs/engines.md); empty for the default one",
    )
    # Beside source: the other files of the weights' repository the engine loads with it (a
    # Hugging Face snapshot's tokenizer, config and safetensors shards), at the source's
    # revision (repository_files), so that they move with every update and rollback as the
    # projector does; their sha256 are in origin's files with the source's.
    files = models.JSONField(
        default=list,
        blank=True,
        help_text="the other files of the weights' repository its engine loads, by their paths there",
    )
    # Its engines rank documents (/v1/rerank; the engine's reranking mode, a reranker's weights)
    # instead of computing embeddings (/v1/embeddings).
    reranking = models.BooleanField(
        default=False,
        help_text="its engines rank documents (/v1/rerank) instead of computing embeddings",
    )
    routing = models.CharField(
        max_length=20,
        blank=True,
        default="",
        help_text="how the gateway picks a replica: prefix (the default) or least_loaded",
    )
    profiles = models.JSONField(default=list)
    adapters = models.JSONField(default=list, blank=True)
    declared = models.BooleanField(
        default=False, help_text="declared in server.yaml (re-read on every start)"
    )
    # Bumped by a rolling restart: replicas started under an older generation
    # are out of date and replaced one at a time.
    generation = models.PositiveIntegerField(default=0)
    source_size = models.BigIntegerField(null=True, blank=True)
    # Runtime state kept by the fleet, not part of the definition:
    # when an on-demand model was last asked for,
    demand_at = models.DateTimeField(null=True, blank=True)
    # and how many replicas of its current spec failed to become ready in a row;
    # at the limit, replacement halts (rollout_halted says why) and the old
    # replicas keep serving until the spec changes again.
    rollout_failures = models.PositiveIntegerField(default=0)
    rollout_halted = models.TextField(blank=True, default="")
    rollout_spec_key = models.CharField(max_length=64, blank=True, default="")
    # Where the weights came from in the registry: {repo, branch, commit, files: [{path, sha256, size}]}.
    origin = models.JSONField(null=True, blank=True)
    # What a rollback goes back to: {source, sha256, origin}; its files stay in the mirror.
    previous = models.JSONField(null=True, blank=True)
    # Newer weights seen by the last check: {commit, files: [{path, sha256, size}], bytes, checked_at}.
    # A rollback keeps the revision it went back from (or a newer one the check saw) here, its
    # files compared with those rolled back to, with rolled_back_from: the commit it left.
    update_available = models.JSONField(null=True, blank=True)
    update_checked_at = models.DateTimeField(null=True, blank=True)
    update_check_error = models.TextField(blank=True, default="")
    # A canary update: what the gateway routes by while it runs ({percent, revision, state,
    # ...}, see canary_routing) and, once it ended, its outcome and the figures that decided it.
    canary = models.JSONField(null=True, blank=True)
    # An autoscale policy it opted into ({wait, up_after, down_after}, in seconds; None: the
    # replica count is its min, as ever), and what the autoscaler last decided under it
    # ({replicas, why, ...}: fleet.autoscale writes it, desired_replicas reads its replicas).
    autoscale = models.JSONField(null=True, blank=True)
    autoscale_state = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    # -- scaling in force -------------------------------------------------------

    @property
    def effective_max(self) -> int:
        return max_in_force(self.min_replicas, self.max_replicas)

    @property
    def on_demand(self) -> bool:
        return is_on_demand(self.min_replicas, self.max_replicas)

    @property
    def parked(self) -> bool:
        return is_parked(self.min_replicas, self.max_replicas)

    def desired_replicas(self, now: datetime, default_idle: int) -> int:
        """The replica count the reconciler aims for now: its floor (`floor_replicas`) or, with
        an autoscale policy and while the floor is not 0, the count the autoscaler set, within
        the floor and max in force. Every door that shows a wanted count (API, plan, console,
        rollouts) asks this."""
        floor = self.floor_replicas(now, default_idle)
        if floor == 0 or not self.autoscale:
            return floor
        scaled = (self.autoscale_state or {}).get("replicas")
        if not isinstance(scaled, int) or isinstance(scaled, bool):
            return floor
        return max(floor, min(scaled, self.effective_max))

    def floor_replicas(self, now: datetime, default_idle: int) -> int:
        """The replica count without autoscaling: min_replicas; for an on-demand model, one
        while it was asked for within its idle timeout, else none."""
        if self.min_replicas > 0:
            return self.min_replicas
        if not self.on_demand or self.demand_at is None:
            return 0
        idle = self.idle_timeout_in_force(default_idle)
        return 1 if now - self.demand_at < timedelta(seconds=idle) else 0

    def may_be_changed_by(self, user: Any) -> bool:
        """Its owner and staff may change a model (server.yaml and the system act as neither;
        catalog.services.require_change_rights lets them, and says why to everyone else)."""
        if user is None:
            return False
        return bool(
            getattr(user, "is_staff", False)
            or (self.owner_id is not None and self.owner_id == user.pk)
        )

    @property
    def class_in_force(self) -> str:
        if self.model_class:
            return self.model_class
        return "opportunistic" if self.on_demand else "standard"

    def idle_timeout_in_force(self, cluster_default: int) -> int:
        return self.idle_timeout or cluster_default

    @property
    def canary_in_force(self) -> CanaryRouting | None:
        return canary_routing(self.canary)

    @property
    def engine_name(self) -> str:
        """The engine its replicas run (the default one when the definition names none)."""
        return engine_of(self.engine)

    @property
    def snapshot_files(self) -> tuple[Projector, ...]:
        """The other files its engine loads beside the source, at the source's revision."""
        if not self.files:
            return ()  # origin is not read: a one-file model's reads stay what they were
        return tuple(repository_file(self.source, path, self.origin) for path in self.files)

    @property
    def projector(self) -> Projector | None:
        """The vision projector in force, at the weights' revision; None without one."""
        if not self.mmproj:
            return None  # origin is not read: a text model's reads stay what they were
        return projector_of(self.source, self.mmproj, self.origin)

    # -- the definition, as written in server.yaml ------------------------------

    def definition(self) -> dict[str, Any]:
        """The model as the YAML schema writes it; `model add -f` takes it back unchanged."""
        data: dict[str, Any] = {"name": self.name, "source": self.source}
        if self.sha256:
            data["sha256"] = self.sha256
        if self.description:
            data["description"] = self.description
        if self.owner is not None:
            data["owner"] = self.owner.username
        if self.model_class:
            data["class"] = self.model_class
        data["min_replicas"] = self.min_replicas
        if self.max_replicas is not None:
            data["max_replicas"] = self.max_replicas
        if self.idle_timeout:
            data["idle_timeout"] = format_duration(self.idle_timeout)
        if self.fallbacks:
            data["fallbacks"] = list(self.fallbacks)
        if self.context_length is not None:
            data["context_length"] = self.context_length
        if self.mmproj:
            data["mmproj"] = self.mmproj
        if self.engine:
            data["engine"] = self.engine
        if self.files:
            data["files"] = list(self.files)
        if self.reranking:
            data["reranking"] = True
        if self.routing:
            data["routing"] = self.routing
        data["profiles"] = [dict(p) for p in self.profiles]
        if self.adapters:
            data["adapters"] = [dict(a) for a in self.adapters]
        if self.autoscale:
            data["autoscale"] = {k: format_duration(v) for k, v in self.autoscale.items()}
        return data


class CatalogVersion(models.Model):
    """A single row, locked by every catalog write and bumped by it.

    Validation looks at the whole would-be catalog; holding this lock while
    doing so means two concurrent changes cannot each pass against a catalog
    that the other is about to change (say, two adds of the same adapter name).
    """

    version = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"catalog version {self.version}"


class AuditEntry(models.Model):
    """Who changed what, when, through which door; written in the change's transaction."""

    DOORS = [
        ("api", "API"),
        ("cli", "llmgw ctl"),
        ("console", "console"),
        ("admin", "admin"),
        ("config", "server.yaml"),
        ("system", "system"),
    ]

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    # Kept as text as well: entries outlive users, and "config"/"system" act
    # without being users.
    actor_name = models.CharField(max_length=150, db_index=True)
    model_name = models.CharField(max_length=100, db_index=True)
    action = models.CharField(max_length=40, db_index=True)
    door = models.CharField(max_length=20, choices=DOORS)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    changes = models.JSONField(default=dict, blank=True)
    note = models.TextField(blank=True, default="")
    # The trace of the work the entry is part of (a rollout's, llmgw.tracing), "" for none.
    trace_id = models.CharField(max_length=32, blank=True, default="")

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["model_name", "-at"])]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_name} {self.action} {self.model_name}"
