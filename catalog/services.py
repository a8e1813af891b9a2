"""Every write to the catalog: add, remove, scale, resources, class, owner, adapters, server.yaml.

Views, API classes, the admin, the CLI (through the API) and start-up all call
these, so they cannot disagree. Each one builds the would-be catalog, validates
it whole, writes, and records its audit entry in the same transaction; a refused
change writes nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from core.actor import CONFIG, Actor
from core.refusals import Problem, Refused, conflict, forbidden, invalid

from .config import current_config
from .definitions import (
    CLASSES,
    MAX_CORES,
    MAX_MEMORY_GB,
    MAX_REPLICAS,
    autoscale_room,
    clean_autoscale,
    whole_if_possible,
)
from .models import AuditEntry, CatalogVersion, Model, projector_source
from .signals import catalog_changed, model_added
from .sources import check_adapter, check_source
from .validation import catalog_problems

if TYPE_CHECKING:
    from .config import ClusterConfig


def model_not_found(name: str, known: list[str] | None = None) -> Refused:
    hint = "; `llmgw ctl models` lists the models there are"
    if known:
        close = difflib.get_close_matches(name, known, n=3)
        if close:
            hint = f"; did you mean {', '.join(close)}?"
    end = "" if hint.endswith("?") else "."
    return Refused(f"There is no model named {name!r}{hint}{end}", code="not_found", status=404)


# -- shared steps ---------------------------------------------------------------


def lock_catalog() -> None:
    """Hold the catalog lock until the transaction ends (see CatalogVersion)."""
    # The migration creates the row; a database flushed since (as tests do) gets it back here.
    CatalogVersion.objects.get_or_create(pk=1)
    row = CatalogVersion.objects.select_for_update().get(pk=1)
    row.version += 1
    row.save(update_fields=["version"])


def catalog_snapshot() -> dict[str, dict[str, Any]]:
    """What whole-catalog validation needs of every model, in one query."""
    return {
        row["name"]: {"fallbacks": row["fallbacks"], "adapters": row["adapters"]}
        for row in Model.objects.values("name", "fallbacks", "adapters")
    }


def refuse_if_invalid(catalog: dict[str, dict[str, Any]], changed: Iterable[str]) -> None:
    problems = catalog_problems(catalog, changed=changed)
    if problems:
        raise invalid(problems, what="The change")


def get_model(name: str) -> Model:
    try:
        return Model.objects.select_related("owner").get(name=name)
    except Model.DoesNotExist:
        raise model_not_found(name, list(Model.objects.values_list("name", flat=True))) from None


def require_change_rights(actor: Actor, model: Model) -> None:
    """The owner or staff may change a model. Asked before anything else about the change (who
    the new owner is, whether a file exists), so that an outsider learns nothing from the answer
    and makes the control plane fetch nothing."""
    if actor.is_installation or model.may_be_changed_by(actor.user):
        return
    if model.owner is None:
        raise forbidden(f"{model.name} has no owner, so only a staff user may change it.")
    raise forbidden(
        f"{model.name} belongs to {model.owner.username}; only they or a staff user may change it. "
        f"Ask them, or ask staff to hand it over with `llmgw ctl model owner {model.name} USER`."
    )


def refuse_if_declared(model: Model, what: str) -> None:
    if model.declared:
        path = current_config().path
        raise conflict(
            f"{model.name} is declared in {path}, which is read again on every start, so {what}. "
            f"Change it in {path} instead.",
            code="declared_model",
        )


def record_change(
    actor: Actor,
    model_name: str,
    action: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    note: str = "",
    *,
    trace_id: str = "",
) -> AuditEntry:
    entry = audit_entry(actor, model_name, action, note, before=before, after=after)
    entry.trace_id = trace_id
    entry.save()
    return entry


def audit_entry(
    actor: Actor,
    model_name: str,
    action: str,
    note: str = "",
    *,
    before: Any = None,
    after: Any = None,
) -> AuditEntry:
    """The audit entry of a change or an event, not yet saved: record_change and record_event
    save one; the reconciler saves a pass's in one query."""
    changes: dict[str, list[Any]] = {}
    for key in dict.fromkeys([*(before or {}), *(after or {})]):
        old = (before or {}).get(key)
        new = (after or {}).get(key)
        if old != new:
            changes[key] = [old, new]
    return AuditEntry(
        actor=actor.user,
        actor_name=actor.name,
        model_name=model_name,
        action=action,
        door=actor.door,
        before=before,
        after=after,
        changes=changes,
        note=note,
    )


def record_event(
    actor: Actor, model_name: str, action: str, note: str, *, trace_id: str = "", **details: Any
) -> AuditEntry:
    """An audit entry for something that is not a change of definition (a preemption, a restart)."""
    return record_change(actor, model_name, action, None, details or None, note, trace_id=trace_id)


def announce(*names: str) -> None:
    transaction.on_commit(lambda: catalog_changed.send(sender=Model, names=list(names)))


def _resolve_user(username: str) -> Any:
    User = get_user_model()
    try:
        return User.objects.get(username=username)
    except User.DoesNotExist:
        raise Refused(
            f"There is no user named {username!r}; create the account first (console or admin).",
            code="unknown_user",
        ) from None


def apply_definition(model: Model, definition: dict[str, Any]) -> None:
    model.source = definition["source"]
    model.sha256 = definition.get("sha256", "")
    model.description = definition.get("description", "")
    model.model_class = definition.get("class", "")
    model.min_replicas = definition["min_replicas"]
    model.max_replicas = definition.get("max_replicas")
    model.idle_timeout = definition.get("idle_timeout", 0)
    model.fallbacks = definition.get("fallbacks", [])
    model.context_length = definition.get("context_length")
    model.mmproj = definition.get("mmproj", "")
    model.engine = definition.get("engine", "")
    model.files = definition.get("files", [])
    model.reranking = definition.get("reranking", False)
    model.routing = definition.get("routing", "")
    model.profiles = definition["profiles"]
    model.adapters = definition.get("adapters", [])
    autoscale = definition.get("autoscale")
    if autoscale != model.autoscale:
        model.autoscale = autoscale
        model.autoscale_state = None  # a new policy (or none) starts from the floor


# -- add and remove -------------------------------------------------------------


def model_add(*, actor: Actor, definition: dict[str, Any], source_check: bool = True) -> Model:
    """Add a runtime model; the one adding it becomes its owner (staff may name another)."""
    owner = actor.user
    wanted_owner = definition.get("owner")
    if wanted_owner and (owner is None or wanted_owner != owner.get_username()):
        if not actor.is_staff:
            raise forbidden(
                f"Adding a model makes you its owner; only staff may add one owned by "
                f"{wanted_owner}. Leave owner out (or set it to yourself)."
            )
        owner = _resolve_user(wanted_owner)

    source_size = None
    if source_check:
        source_size = check_source(definition["source"]).size
        if definition.get("mmproj"):
            check_source(
                projector_source(definition["source"], definition["mmproj"]),
                what=f"projector {definition['mmproj']!r}",
            )
        for adapter in definition.get("adapters", []):
            check_adapter(adapter, model_name=definition["name"], model_source=definition["source"])

    with transaction.atomic():
        lock_catalog()
        existing = Model.objects.select_related("owner").filter(name=definition["name"]).first()
        if existing is not None:
            who = f"owned by {existing.owner.username}" if existing.owner else "with no owner"
            kind = "declared in server.yaml" if existing.declared else "added at runtime"
            raise conflict(
                f"A model named {existing.name} already exists ({kind}, {who}). "
                "Choose another name, or remove that one first.",
                code="name_taken",
            )
        catalog = catalog_snapshot()
        catalog[definition["name"]] = definition
        refuse_if_invalid(catalog, [definition["name"]])
        model = Model(name=definition["name"], owner=owner, declared=False, source_size=source_size)
        apply_definition(model, definition)
        model.save()
        model_added.send(sender=Model, model=model)
        record_change(actor, model.name, "add", None, model.definition())
        announce(model.name)
    return model


def model_remove(*, actor: Actor, name: str) -> None:
    with transaction.atomic():
        lock_catalog()
        model = get_model(name)
        require_change_rights(actor, model)
        refuse_if_declared(model, "removing it here would only last until then: it would come back")
        dependents = _falling_back_to([name])
        declared = [d.name for d in dependents if d.declared]
        if declared:
            # Dropped here, the fallback would come back with server.yaml on the next start,
            # which would then refuse the file for naming a model that does not exist.
            path = current_config().path
            raise conflict(
                f"{name} cannot be removed: {', '.join(declared)} "
                f"{'falls' if len(declared) == 1 else 'fall'} back to it and "
                f"{'is' if len(declared) == 1 else 'are'} declared in {path}. "
                f"Ask an administrator to take {name} out of those fallbacks in {path} first.",
                code="fallback_target",
            )
        before = model.definition()
        model.delete()
        record_change(actor, name, "remove", before, None)
        dropped = _drop_fallbacks(actor, dependents, [name], why=f"{actor.name} removed it")
        announce(name, *dropped)


def _falling_back_to(names: Iterable[str]) -> list[Model]:
    """The other models that fall back to any of `names`."""
    wanted = set(names)
    # Fallbacks are a JSON list, which SQLite cannot search inside: the names are read,
    # and only the models that name one of these are loaded whole.
    pks = [
        pk
        for pk, name, fallbacks in Model.objects.values_list("pk", "name", "fallbacks")
        if name not in wanted and wanted.intersection(fallbacks)
    ]
    return list(Model.objects.select_related("owner").filter(pk__in=pks))


def _drop_fallbacks(
    actor: Actor, dependents: list[Model], gone: list[str], *, why: str
) -> list[str]:
    """Take `gone` out of each dependent's fallbacks, audited as the actor who removed them.

    Why not refuse instead: a fallback is the dependent owner's choice, and anyone may name
    any model as one, so refusing would let any user make someone else's model unremovable.
    The dependent keeps answering; only the stand-in is gone.
    """
    dropped = []
    for dependent in dependents:
        before = dependent.definition()
        lost = [f for f in dependent.fallbacks if f in gone]
        dependent.fallbacks = [f for f in dependent.fallbacks if f not in gone]
        dependent.save(update_fields=["fallbacks", "updated_at"])
        record_change(
            actor,
            dependent.name,
            "fallback-dropped",
            before,
            dependent.definition(),
            note=f"{dependent.name} no longer falls back to {', '.join(lost)}: {why}",
        )
        dropped.append(dependent.name)
    return dropped


# -- changes to one model -------------------------------------------------------


def _change(actor: Actor, name: str, action: str, declared_effect: str, apply: Any) -> Model:
    """Lock, load, check rights, apply, validate the whole catalog, save, audit."""
    with transaction.atomic():
        lock_catalog()
        model = get_model(name)
        require_change_rights(actor, model)
        refuse_if_declared(model, declared_effect)
        before = model.definition()
        apply(model)
        catalog = catalog_snapshot()
        catalog[model.name] = {"fallbacks": model.fallbacks, "adapters": model.adapters}
        refuse_if_invalid(catalog, [model.name])
        model.save()
        after = model.definition()
        if after != before:
            record_change(actor, model.name, action, before, after)
            announce(model.name)
    return model


def _replica_count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPLICAS:
        raise invalid(
            [Problem(field, f"must be a whole number from 0 to {MAX_REPLICAS}")], what="The scale"
        )
    return value


def model_scale(
    *,
    actor: Actor,
    name: str,
    min_replicas: int,
    max_replicas: int | None = None,
    idle_timeout: int | None = None,
) -> Model:
    """Set the replica count (min), the ceiling (max; None follows min) and the idle timeout."""
    minimum = _replica_count(min_replicas, "min")
    maximum = None if max_replicas is None else _replica_count(max_replicas, "max")
    if maximum is not None and minimum > maximum:
        raise invalid(
            [
                Problem(
                    "max",
                    f"max ({maximum}) is below min ({minimum}); max is a ceiling, so it must be "
                    "at least min, or left out to follow min",
                )
            ],
            what="The scale",
        )

    def apply(model: Model) -> None:
        model.min_replicas = minimum
        model.max_replicas = maximum
        if idle_timeout is not None:
            model.idle_timeout = idle_timeout

    return _change(actor, name, "scale", "a scale set here would revert then", apply)


def model_set_resources(
    *,
    actor: Actor,
    name: str,
    memory_gb: float,
    cores: float | None = None,
    profile: str | None = None,
) -> Model:
    """Set what a replica reserves of a node, for one profile or every profile."""
    problems = []
    if not 0 <= memory_gb <= MAX_MEMORY_GB:
        problems.append(Problem("memory", f"must be from 0 to {MAX_MEMORY_GB} GB"))
    if cores is not None and not 0 <= cores <= MAX_CORES:
        problems.append(Problem("cores", f"must be from 0 to {MAX_CORES}"))
    if problems:
        raise invalid(problems, what="The resources")

    def apply(model: Model) -> None:
        names = [p["name"] for p in model.profiles]
        if profile is not None and profile not in names:
            raise invalid(
                [
                    Problem(
                        "profile",
                        f"{model.name} has no profile {profile!r}; it has {', '.join(names)}",
                    )
                ],
                what="The resources",
            )
        profiles = []
        for entry in model.profiles:
            entry = dict(entry)
            if profile is None or entry["name"] == profile:
                entry["memory_gb"] = whole_if_possible(memory_gb)
                if cores is not None:
                    entry["cores"] = whole_if_possible(cores)
            profiles.append(entry)
        model.profiles = profiles

    return _change(actor, name, "resources", "resources set here would revert then", apply)


def model_autoscale(*, actor: Actor, name: str, policy: dict[str, Any] | None) -> Model:
    """Turn a model's autoscale policy on (`policy`: wait, and up_after and down_after, each a
    duration like 2s or 10m, checked as server.yaml's are) or off (None). A model needs a max
    above its floor for a policy to have room; a new policy starts from the floor."""
    cleaned = None if policy is None else clean_autoscale(policy)

    def apply(model: Model) -> None:
        if cleaned is not None:
            room = autoscale_room(model.min_replicas, model.max_replicas)
            if room:
                raise invalid(
                    [Problem("autoscale", f"{model.name}: {room} (scale it with --max)")],
                    what="The autoscale policy",
                )
        if cleaned != model.autoscale:
            model.autoscale = cleaned
            model.autoscale_state = None

    return _change(actor, name, "autoscale", "a policy set here would revert then", apply)


def model_set_class(*, actor: Actor, name: str, klass: str) -> Model:
    """critical, standard, opportunistic, or default ("" or "default": follows the scaling)."""
    value = "" if klass in ("", "default") else klass
    if value and value not in CLASSES:
        raise invalid(
            [Problem("class", f"{klass!r} is not a class: use {', '.join(CLASSES)} or default")],
            what="The class",
        )

    def apply(model: Model) -> None:
        model.model_class = value

    return _change(actor, name, "class", "a class set here would revert then", apply)


def model_set_owner(*, actor: Actor, name: str, username: str) -> Model:
    def apply(model: Model) -> None:
        # Looked up only once the rights are checked: whether a username exists is not
        # for outsiders to learn.
        model.owner = _resolve_user(username)

    return _change(actor, name, "owner", "an owner set here would revert then", apply)


def model_set_adapters(
    *,
    actor: Actor,
    name: str,
    add: list[dict[str, Any]] | None = None,
    remove: list[str] | None = None,
    source_check: bool = True,
) -> Model:
    """Remove then add LoRA adapters (so --remove X --add X=URL replaces X)."""
    add = add or []
    remove = remove or []
    if source_check and add:
        # The rights first: an outsider must not make the control plane fetch anything.
        model = get_model(name)
        require_change_rights(actor, model)
        refuse_if_declared(model, "adapters set here would revert then")
        for adapter in add:
            check_adapter(adapter, model_name=model.name, model_source=model.source)

    def apply(model: Model) -> None:
        current = [dict(a) for a in model.adapters]
        names = [a["name"] for a in current]
        missing = [r for r in remove if r not in names]
        if missing:
            raise invalid(
                [
                    Problem(
                        "remove",
                        f"{model.name} has no adapter {r!r}; it has {', '.join(names) or 'none'}",
                    )
                    for r in missing
                ],
                what="The adapter change",
            )
        current = [a for a in current if a["name"] not in remove]
        kept = {a["name"] for a in current}
        clashes = [a["name"] for a in add if a["name"] in kept]
        if clashes:
            raise invalid(
                [
                    Problem(
                        "add",
                        f"{model.name} already has an adapter {c!r}; remove it in the same "
                        f"change to replace it (--remove {c} --add {c}=URL)",
                    )
                    for c in clashes
                ],
                what="The adapter change",
            )
        model.adapters = current + add

    return _change(actor, name, "adapters", "adapters set here would revert then", apply)


# -- server.yaml ----------------------------------------------------------------


def _config_owner(username: str | None) -> Any:
    if not username:
        return None
    User = get_user_model()
    user, created = User.objects.get_or_create(username=username)
    if created:
        # The account exists so that the model has an owner; staff give it a
        # password when that person should log in.
        user.set_unusable_password()
        user.save()
    return user


def config_apply(config: ClusterConfig) -> dict[str, list[str]]:
    """Bring the declared models in line with server.yaml; refuse the whole file if it does not fit."""
    with transaction.atomic():
        lock_catalog()
        existing = {m.name: m for m in Model.objects.select_related("owner")}
        wanted = {d["name"]: d for d in config.models}
        _refuse_runtime_clashes(existing, wanted)
        gone = [n for n, m in existing.items() if m.declared and n not in wanted]
        # A runtime model that fell back to a declared one gone from the file loses that
        # fallback, as it does when its target is removed at runtime (a declared model that
        # still names it is the file's own problem, and refused below).
        stranded = [m for m in _falling_back_to(gone) if not m.declared]
        _refuse_invalid_config(wanted, gone, stranded)
        removed = _remove_gone_from_config(existing, gone, config.path)
        dropped = _drop_fallbacks(CONFIG, stranded, gone, why=f"gone from {config.path}")
        created, updated = _write_declared(existing, wanted, config.path)
        changed = [*created, *updated, *removed, *dropped]
        if changed:
            announce(*changed)
    return {"created": created, "updated": updated, "removed": removed}


def _refuse_runtime_clashes(existing: dict[str, Model], wanted: dict[str, Any]) -> None:
    """A declared name that a model added at runtime holds already is refused: neither wins."""
    clashes = [n for n in wanted if n in existing and not existing[n].declared]
    if clashes:
        runtime = existing[clashes[0]]
        raise conflict(
            f"{clashes[0]} is declared in the file, but a model of that name was added at "
            f"runtime (owner {runtime.owner.username if runtime.owner else 'none'}). Rename "
            "the declared one, or remove the runtime one with `llmgw ctl model remove`.",
            code="name_taken",
        )


def _refuse_invalid_config(wanted: dict[str, Any], gone: list[str], stranded: list[Model]) -> None:
    """Validate the catalog the file would make: the declared models as written, those gone
    from it removed, and the runtime models that fell back to those without that fallback."""
    catalog = catalog_snapshot()
    for name in gone:
        catalog.pop(name)
    for model in stranded:
        catalog[model.name] = {
            **catalog[model.name],
            "fallbacks": [f for f in model.fallbacks if f not in gone],
        }
    catalog.update(wanted)
    refuse_if_invalid(catalog, list(wanted))


def _remove_gone_from_config(existing: dict[str, Model], gone: list[str], path: Path) -> list[str]:
    for name in gone:
        model = existing[name]
        record_change(
            CONFIG,
            name,
            "remove",
            model.definition(),
            None,
            note=f"gone from {path}",
        )
        model.delete()
    return list(gone)


def _write_declared(
    existing: dict[str, Model], wanted: dict[str, Any], path: Path
) -> tuple[list[str], list[str]]:
    """Add or update each declared model whose definition differs: (created, updated)."""
    created: list[str] = []
    updated: list[str] = []
    for name, definition in wanted.items():
        model = existing.get(name) or Model(name=name, declared=True)
        before = model.definition() if model.pk else None
        apply_definition(model, definition)
        model.owner = _config_owner(definition.get("owner"))
        after = model.definition()
        if before == after:
            continue
        model.save()
        record_change(
            CONFIG,
            name,
            "update" if before else "add",
            before,
            after,
            note=f"from {path}",
        )
        (updated if before else created).append(name)
    return created, updated


# -- runtime requests -----------------------------------------------------------


def model_restart(*, actor: Actor, name: str) -> Model:
    """A rolling restart: every replica is replaced, one at a time (declared models too)."""
    with transaction.atomic():
        lock_catalog()
        model = get_model(name)
        require_change_rights(actor, model)
        model.generation += 1
        model.save(update_fields=["generation", "updated_at"])
        record_change(
            actor,
            name,
            "restart",
            {"generation": model.generation - 1},
            {"generation": model.generation},
        )
        announce(name)
    return model


def model_demand(*, name: str, actor: Actor | None = None) -> Model:
    """Someone asked for the model: an on-demand model is loaded, and its idle clock restarts.

    The gateway records demand for any request it routes (actor None: using a model through
    the gateway is open to every key). Asked for directly (`actor` given), loading a model is a
    change of what runs on the shared nodes, so it takes the rights to change the model.
    """
    model = get_model(name)
    if actor is not None:
        require_change_rights(actor, model)
    first = model.demand_at is None
    model.demand_at = timezone.now()
    Model.objects.filter(pk=model.pk).update(demand_at=model.demand_at)
    if model.on_demand and (first or not model.replicas.filter(withdrawn_at__isnull=True).exists()):
        announce(name)
    return model
