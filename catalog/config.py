"""server.yaml: cluster settings and the declared models, read and validated.

The file is read on every start of web, worker and beat (llmgw_site.startup applies it).
A file that does not validate stops the start with a message naming the file, the entry
and the field, because running on a half-understood configuration is worse than not
running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from django.conf import settings
from rest_framework import serializers

from core.durations import format_duration
from core.outbound import (
    HostSyntaxError,
    URLRefused,
    endpoint_hosts,
    parse_allowed_hosts,
    parse_target,
)
from core.refusals import Problem, Refused
from core.serializers import DurationField, StrictSerializer, flatten_errors, path_text
from core.yamltext import YAMLSyntaxError, line_for, load_with_lines

from .definitions import clean_definition


class ConfigError(Exception):
    pass


DEFAULT_REGISTRY = "https://huggingface.co"


@dataclass(frozen=True)
class ClusterConfig:
    path: Path
    reconcile_interval: int = 5
    default_idle_timeout: int = 15 * 60
    node_lost_after: int = 30
    update_check: int = 6 * 3600
    mirror_root: Path = Path("var/mirror")
    registry_endpoint: str = DEFAULT_REGISTRY
    # Who named the registry: "LLMGW_REGISTRY_ENDPOINT", "registry.endpoint in PATH", or "" when
    # nobody did and the default is in force. Only then does the run command put its demo
    # registry in its place: a user who names Hugging Face itself means Hugging Face.
    registry_named_by: str = ""
    registry_token: str = ""
    allowed_hosts: tuple[str, ...] | None = None
    models: list[dict[str, Any]] = field(default_factory=list)

    def source_allowed_hosts(self) -> tuple[str, ...]:
        """Hosts the control plane may ask about a source: env, then file, then mirror + registry."""
        if settings.LLMGW_SOURCE_ALLOWED_HOSTS is not None:
            return tuple(settings.LLMGW_SOURCE_ALLOWED_HOSTS)
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        hosts = (
            *endpoint_hosts(settings.LLMGW_PUBLIC_URL),
            *endpoint_hosts(self.registry_endpoint),
        )
        return tuple(dict.fromkeys(hosts))

    def summary(self) -> dict[str, Any]:
        return {
            "reconcile_interval": format_duration(self.reconcile_interval),
            "default_idle_timeout": format_duration(self.default_idle_timeout),
            "node_lost_after": format_duration(self.node_lost_after),
            "update_check": format_duration(self.update_check),
            "registry_endpoint": self.registry_endpoint,
            "source_allowed_hosts": list(self.source_allowed_hosts()),
        }


class _ClusterSection(StrictSerializer):
    reconcile_interval = DurationField(required=False, default=5)
    default_idle_timeout = DurationField(required=False, default=15 * 60)
    node_lost_after = DurationField(required=False, default=30)


class _MirrorSection(StrictSerializer):
    update_check = DurationField(required=False, default=6 * 3600)
    root = serializers.CharField(required=False)  # type: ignore[assignment]


class _RegistrySection(StrictSerializer):
    # No default here: ClusterConfig needs to know whether the file named one (registry_named_by).
    endpoint = serializers.URLField(required=False)
    token = serializers.CharField(required=False, allow_blank=True, default="")

    def validate_endpoint(self, value: str) -> str:
        # Every registry request is checked by core.outbound; an endpoint it would refuse
        # (a password in the URL, an odd host) is better refused at start.
        try:
            parse_target(value)
        except URLRefused as exc:
            raise serializers.ValidationError(exc.message) from None
        return value


class _SourcesSection(StrictSerializer):
    allowed_hosts = serializers.ListField(child=serializers.CharField(), required=False)

    def validate_allowed_hosts(self, value: list[str]) -> list[str]:
        try:
            parse_allowed_hosts(value)
        except HostSyntaxError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value


class _ServerFile(StrictSerializer):
    cluster = _ClusterSection(required=False)
    mirror = _MirrorSection(required=False)
    registry = _RegistrySection(required=False)
    sources = _SourcesSection(required=False)
    # Each entry is checked by the definition serializer, so that the error
    # can name the entry.
    models = serializers.ListField(child=serializers.JSONField(), required=False, default=list)

    def validate_cluster(self, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("reconcile_interval", 5) < 1:
            raise serializers.ValidationError({"reconcile_interval": ["must be at least 1s"]})
        return value


def parse_config(text: str, path: Path) -> ClusterConfig:
    """The cluster configuration in `text`, or ConfigError naming the file, entry and field."""
    try:
        data, lines = load_with_lines(text)
    except YAMLSyntaxError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the file must be a mapping with cluster, mirror, registry, sources and models"
        )
    top = _ServerFile(data=data)
    if not top.is_valid():
        first_path, message = flatten_errors(top.errors)[0]
        line = line_for(lines, first_path)
        raise ConfigError(
            f"{path}: {path_text(first_path)}: {message}" + (f" (line {line})" if line else "")
        )
    values = top.validated_data
    models = []
    names: set[str] = set()
    for index, entry in enumerate(values.get("models", [])):
        label = f"models[{index}]"
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            label += f" ({entry['name']})"
        try:
            definition = clean_definition(entry, lines=lines, prefix=("models", index), what=label)
        except Refused as exc:
            raise ConfigError(f"{path}: {_problem_text(exc, label)}") from None
        if definition["name"] in names:
            raise ConfigError(f"{path}: {label}: the name {definition['name']!r} is declared twice")
        names.add(definition["name"])
        models.append(definition)
    cluster = values.get("cluster", {})
    mirror = values.get("mirror", {})
    registry = values.get("registry", {})
    sources = values.get("sources", {})
    root = Path(mirror.get("root") or settings.VAR_DIR / "mirror")
    hosts = sources.get("allowed_hosts")
    # The environment wins, as for allowed hosts: the run command points it at its demo
    # registry when nobody named one.
    if settings.LLMGW_REGISTRY_ENDPOINT:
        endpoint, named_by = settings.LLMGW_REGISTRY_ENDPOINT, "LLMGW_REGISTRY_ENDPOINT"
    elif "endpoint" in registry:
        endpoint, named_by = registry["endpoint"], f"registry.endpoint in {path}"
    else:
        endpoint, named_by = DEFAULT_REGISTRY, ""
    return ClusterConfig(
        path=path,
        reconcile_interval=cluster.get("reconcile_interval", 5),
        default_idle_timeout=cluster.get("default_idle_timeout", 15 * 60),
        node_lost_after=cluster.get("node_lost_after", 30),
        update_check=mirror.get("update_check", 6 * 3600),
        mirror_root=root if root.is_absolute() else settings.BASE_DIR / root,
        registry_endpoint=endpoint,
        registry_named_by=named_by,
        registry_token=registry.get("token", ""),
        allowed_hosts=tuple(hosts) if hosts is not None else None,
        models=models,
    )


def _problem_text(exc: Refused, label: str) -> str:
    if not exc.problems:
        return f"{label}: {exc.message}"
    first: Problem = exc.problems[0]
    where = f" (line {first.line})" if first.line else ""
    return f"{label}: {first.field or 'entry'}: {first.message}{where}"


def load_config(path: Path | None = None) -> ClusterConfig:
    path = Path(path or settings.LLMGW_CONFIG)
    if settings.LLMGW_SOURCE_ALLOWED_HOSTS is not None:
        try:
            parse_allowed_hosts(settings.LLMGW_SOURCE_ALLOWED_HOSTS)
        except HostSyntaxError as exc:
            raise ConfigError(f"LLMGW_SOURCE_ALLOWED_HOSTS: {exc}") from None
    if not path.exists():
        return parse_config("", path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror}") from None
    return parse_config(text, path)


@lru_cache(maxsize=1)
def current_config() -> ClusterConfig:
    """This process's configuration, read once (every process reads the file at its start)."""
    return load_config()
