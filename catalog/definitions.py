"""The model definition schema: one serializer for server.yaml and `llmgw ctl model add -f`.

A definition is checked here on its own (types, ranges, names, unknown fields);
`catalog.validation` then checks it against the rest of the catalog.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.outbound import URLRefused, parse_target
from core.refusals import Problem, Refused, invalid
from core.serializers import DurationField, StrictSerializer, flatten_errors, path_text
from core.yamltext import Path, YAMLSyntaxError, line_for, load_with_lines
from llmgw.engines import DEFAULT_ENGINE, engine_names, get_engine

# A name is part of URLs (/api/v1/models/NAME, /console/models/NAME) and of command lines:
# it starts with a letter or digit, so that "." and ".." (which a URL path resolves away)
# and "-x" (which `llmgw ctl` would read as an option) cannot be names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
NAME_CHARACTERS = re.compile(r"^[A-Za-z0-9._:-]+$")
PROFILE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]+$")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
CLASSES = ("critical", "standard", "opportunistic")

# Ceilings well above any real machine: a figure beyond them is a typo (GB for
# MB, an extra zero), and refusing it beats reserving a node that cannot exist.
MAX_REPLICAS = 1000
MAX_MEMORY_GB = 16384
MAX_CORES = 4096
MAX_GPUS = 64
MAX_CONTEXT = 1_048_576
# How the gateway picks among a model's ready replicas (gateway.prefix explains "prefix").
ROUTINGS = ("prefix", "least_loaded")
MAX_SLOTS = 256
# Requests one replica serves at once when a profile does not say: one slot keeps a replica's
# memory what it was (one context of KV cache); raise it where memory allows.
DEFAULT_SLOTS = 1
MAX_NAME = 100
# Layers offloaded to a GPU profile's GPUs: "all" (the default) or a count. No model has this
# many layers; a count above the model's offloads them all, as the engine does.
ALL_LAYERS = "all"
MAX_GPU_LAYERS = 10000
# A vision projector is named by its path in the weights' repository: folders and file names of
# letters, digits, '.', '_' and '-', ending as the engine's weights files do (its
# weights_suffix: the engine reads the projector in its weights' format). No '..', no absolute
# path, no '%' or '\\': the name becomes a URL in the mirror and a path on its disk, and must
# stay inside the repository's folder in both.
MMPROJ_PATTERN = re.compile(
    r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]*/)*[A-Za-z0-9_][A-Za-z0-9._-]*"
    + re.escape(get_engine().weights_suffix)
    + "$"
)
MAX_MMPROJ = 500  # registry.MirrorFile.path's length
# A snapshot's other files, by the same rule as the projector's path but any ending; a snapshot
# of more files than this is not one model's.
REPOSITORY_PATH_PATTERN = re.compile(
    r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]*/)*[A-Za-z0-9_][A-Za-z0-9._-]*$"
)
MAX_FILES = 256


def _path_in_repository(value: str, pattern: re.Pattern[str], what: str) -> bool:
    """Whether `value` is a path the pattern takes, with no '.' or '..' part (a ValidationError
    when it is too long for the mirror's records)."""
    if len(value) > MAX_MMPROJ:
        raise serializers.ValidationError(f"{what} path is at most {MAX_MMPROJ} characters")
    parts = value.split("/")
    return bool(pattern.fullmatch(value)) and not any(p in (".", "..") for p in parts)


def validate_repository_path(value: str) -> None:
    if _path_in_repository(value, REPOSITORY_PATH_PATTERN, "a file's"):
        return
    raise serializers.ValidationError(
        f"{value!r} is not a file of the weights' repository: name it by its path there, like "
        "tokenizer.json or model-00001-of-00002.safetensors (letters, digits, '.', '_' and '-', "
        "folders separated by '/', no '..')"
    )


def validate_name(value: str) -> None:
    if len(value) > MAX_NAME:
        raise serializers.ValidationError(f"names are at most {MAX_NAME} characters")
    if not NAME_CHARACTERS.fullmatch(value):
        raise serializers.ValidationError(
            f"{value!r} has characters a name cannot have: use letters, digits, '.', '_', '-' and ':'"
        )
    if not NAME_PATTERN.fullmatch(value):
        raise serializers.ValidationError(
            f"{value!r} cannot be a name: a name starts with a letter or a digit, because it is "
            "part of URLs such as /api/v1/models/NAME (where '.' and '..' mean something else) "
            "and of llmgw ctl commands (where '-' starts an option)"
        )


def validate_source(value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise serializers.ValidationError(
            f"{value!r} is not an http(s) URL; a source is where the weights are, "
            "usually a mirror URL like http://HOST:PORT/mirror/ORG/REPO/COMMIT/FILE.gguf"
        )
    # Nodes fetch the source even when the control plane's check is skipped: a URL that
    # parsers read differently (user@host, backslashes, odd host forms) is never stored.
    try:
        parse_target(value)
    except URLRefused as exc:
        raise serializers.ValidationError(exc.message) from None


# A definition without a projector leaves mmproj out (stored as ""): every name a request
# sends is at least one character (tests/test_api_schema.py).
MMPROJ_BLANK = "an empty name is no projector: leave mmproj out for a model without images"


def validate_mmproj(value: str) -> None:
    if _path_in_repository(value, MMPROJ_PATTERN, "a projector's"):
        return
    raise serializers.ValidationError(
        f"{value!r} is not a projector file: name the .gguf file by its path in the weights' "
        "repository, like mmproj-model-f16.gguf or vision/mmproj.gguf (letters, digits, '.', "
        "'_' and '-', folders separated by '/', no '..'), or leave mmproj out for a model "
        "without images"
    )


def validate_sha256(value: str) -> None:
    if not SHA256_PATTERN.fullmatch(value):
        raise serializers.ValidationError("a sha256 is 64 lowercase hexadecimal characters")


def _at_most(maximum: str) -> dict[str, Any]:
    """The refusals of a number field that is at least 0 and at most `maximum` (with its unit)."""
    return {"min_value": "must not be negative", "max_value": f"at most {maximum}"}


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": [ALL_LAYERS]},
            {"type": "integer", "minimum": 0, "maximum": MAX_GPU_LAYERS},
        ]
    }
)
class GPULayersField(serializers.Field):
    """``gpu_layers``: "all" or a whole number of layers from 0 to MAX_GPU_LAYERS."""

    MESSAGE = (
        f'must be "{ALL_LAYERS}" (every layer on the GPUs, the default) or a whole number of '
        f"layers from 0 to {MAX_GPU_LAYERS}"
    )
    default_error_messages = {"invalid": MESSAGE, "null": MESSAGE}

    def to_internal_value(self, data: Any) -> str | int:
        if data == ALL_LAYERS:
            return ALL_LAYERS
        # A bool is an int to Python, and "12" or 12.5 is a typo or a misunderstanding.
        if isinstance(data, int) and not isinstance(data, bool) and 0 <= data <= MAX_GPU_LAYERS:
            return data
        self.fail("invalid")

    def to_representation(self, value: Any) -> Any:
        return value


class ProfileSerializer(StrictSerializer):
    name = serializers.CharField(max_length=50)
    memory_gb = serializers.FloatField(
        min_value=0,
        max_value=MAX_MEMORY_GB,
        error_messages={
            "min_value": "must not be negative",
            "max_value": f"more than {MAX_MEMORY_GB} GB is not a real machine; is the figure a typo?",
        },
    )
    cores = serializers.FloatField(
        min_value=0,
        max_value=MAX_CORES,
        default=0,
        error_messages=_at_most(f"{MAX_CORES}"),
    )
    gpus = serializers.IntegerField(
        min_value=0,
        max_value=MAX_GPUS,
        default=0,
        error_messages=_at_most(f"{MAX_GPUS}"),
    )
    gpu_memory_gb = serializers.FloatField(
        min_value=0,
        max_value=MAX_MEMORY_GB,
        default=0,
        error_messages=_at_most(f"{MAX_MEMORY_GB}"),
    )

    slots = serializers.IntegerField(
        min_value=1,
        max_value=MAX_SLOTS,
        required=False,
        help_text=(
            "requests one replica serves at once (default 1); each slot holds a context_length "
            "of KV cache, so memory_gb should cover the weights plus (slots + 1) x that cache "
            "(one more for the prompt cache); placement reserves that estimate from the GGUF "
            "header when memory_gb is less"
        ),
        error_messages={
            "min_value": "a replica serves at least 1 request at a time",
            "max_value": f"at most {MAX_SLOTS} slots",
        },
    )

    gpu_layers = GPULayersField(
        required=False,
        help_text=(
            f'how many of the model\'s layers a GPU profile offloads to its GPUs: "{ALL_LAYERS}" '
            "(the default) or a number; the rest run on the CPU from host memory. Placement "
            "reserves GPU memory for the offloaded share of the weights and KV cache. Only for "
            "a profile with gpus"
        ),
    )

    def validate_name(self, value: str) -> str:
        if not PROFILE_NAME_PATTERN.fullmatch(value):
            raise serializers.ValidationError("use letters, digits, '.', '_' and '-'")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("gpu_layers") is not None and not attrs.get("gpus"):
            raise serializers.ValidationError(
                {
                    "gpu_layers": [
                        "offloads layers to the profile's GPUs, and it has gpus 0: set gpus, or "
                        "leave gpu_layers out"
                    ]
                }
            )
        return attrs


class AdapterSerializer(StrictSerializer):
    name = serializers.CharField(validators=[validate_name])
    source = serializers.CharField(max_length=2000, validators=[validate_source])  # type: ignore[assignment]
    scale = serializers.FloatField(
        min_value=0,
        max_value=10,
        default=1.0,
        error_messages={
            "min_value": "must not be negative",
            "max_value": "a LoRA scale above 10 is not sensible",
        },
    )
    sha256 = serializers.CharField(required=False, validators=[validate_sha256])


# An autoscale policy's figures, in seconds: the queue wait it holds a model to, and how long
# the wait must stay above it (up) or the spare replica stay unused (down) before a step.
AUTOSCALE_UP_AFTER = 30
AUTOSCALE_DOWN_AFTER = 600
AUTOSCALE_MIN_WINDOW = 10  # the gateways' figures come every few seconds: a shorter window is noise
AUTOSCALE_MAX_WAIT = 600


class AutoscaleSerializer(StrictSerializer):
    wait = DurationField(help_text="the queue wait (p50) the model is held under, like 2s")
    up_after = DurationField(required=False, default=AUTOSCALE_UP_AFTER)
    down_after = DurationField(required=False, default=AUTOSCALE_DOWN_AFTER)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        errors: dict[str, list[str]] = {}
        if not 1 <= attrs["wait"] <= AUTOSCALE_MAX_WAIT:
            errors["wait"] = [
                f"must be from 1s to {AUTOSCALE_MAX_WAIT // 60}m: the queue wait (p50) above "
                "which a replica is added"
            ]
        for field in ("up_after", "down_after"):
            if attrs[field] < AUTOSCALE_MIN_WINDOW:
                errors[field] = [
                    f"must be at least {AUTOSCALE_MIN_WINDOW}s: the gateways report their waits "
                    "every few seconds, so a shorter window would act on noise"
                ]
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


def clean_autoscale(data: Any) -> dict[str, int]:
    """An autoscale policy as given (durations as text), checked; a Refused naming each wrong
    field otherwise."""
    serializer = AutoscaleSerializer(data=data)
    if not serializer.is_valid():
        problems = [
            Problem(path_text(path), message) for path, message in flatten_errors(serializer.errors)
        ]
        raise invalid(problems, what="The autoscale policy")
    return dict(serializer.validated_data)


def autoscale_room(min_replicas: int, max_replicas: int | None) -> str:
    """Why a model with this scale gives an autoscale policy nothing to do; "" when it has room:
    a max above its floor (its min, or 1 for an on-demand model)."""
    floor = max(min_replicas, 1)
    if max_replicas is None or max_replicas <= floor:
        ceiling = "no max" if max_replicas is None else f"max {max_replicas}"
        return (
            f"with min {min_replicas} and {ceiling} there is no room to scale: set a max above "
            f"{floor} first"
        )
    return ""


class ModelDefinitionSerializer(StrictSerializer):
    name = serializers.CharField(validators=[validate_name])
    source = serializers.CharField(max_length=2000, validators=[validate_source])  # type: ignore[assignment]
    sha256 = serializers.CharField(required=False, validators=[validate_sha256])
    description = serializers.CharField(
        required=False, allow_blank=True, max_length=2000, default=""
    )
    owner = serializers.CharField(required=False, max_length=150)
    min_replicas = serializers.IntegerField(
        min_value=0,
        max_value=MAX_REPLICAS,
        default=1,
        error_messages=_at_most(f"{MAX_REPLICAS} replicas"),
    )
    max_replicas = serializers.IntegerField(
        min_value=0,
        max_value=MAX_REPLICAS,
        required=False,
        allow_null=True,
        default=None,
        error_messages=_at_most(f"{MAX_REPLICAS} replicas"),
    )
    idle_timeout = DurationField(required=False, default=0)
    fallbacks = serializers.ListField(
        child=serializers.CharField(validators=[validate_name]),
        required=False,
        default=list,
        max_length=16,
    )
    context_length = serializers.IntegerField(
        min_value=1,
        max_value=MAX_CONTEXT,
        required=False,
        allow_null=True,
        default=None,
        error_messages={
            "min_value": "must be at least 1 token",
            "max_value": f"at most {MAX_CONTEXT} tokens",
        },
    )
    mmproj = serializers.CharField(
        required=False,
        default="",
        validators=[validate_mmproj],
        error_messages={"blank": MMPROJ_BLANK},
        help_text=(
            "the vision projector's file in the weights' repository (its path there, like "
            "mmproj-model-f16.gguf), fetched and served at the weights' revision so that the "
            "model takes images; empty for none"
        ),
    )
    engine = serializers.ChoiceField(
        choices=list(engine_names()),
        required=False,
        allow_blank=True,
        default="",
        help_text=(
            f"the engine its replicas run: {', '.join(engine_names())} ({DEFAULT_ENGINE} when "
            "left out); a node runs it only if its agent has it installed"
        ),
        error_messages={
            "invalid_choice": f"{{input}} is not an engine llmgw runs: use one of "
            f"{', '.join(engine_names())}, or leave engine out for {DEFAULT_ENGINE}"
        },
    )
    files = serializers.ListField(
        child=serializers.CharField(validators=[validate_repository_path]),
        required=False,
        default=list,
        max_length=MAX_FILES,
        help_text=(
            "for an engine that loads a Hugging Face snapshot (vllm): the snapshot's other "
            "files (tokenizer, safetensors shards...) by their paths in the weights' repository, "
            "beside the source (its config.json), fetched and served at the source's revision"
        ),
    )
    reranking = serializers.BooleanField(
        required=False,
        default=False,
        help_text=(
            "its engines rank documents (POST /v1/rerank, for a reranker's weights) instead of "
            "computing embeddings (POST /v1/embeddings)"
        ),
    )
    routing = serializers.ChoiceField(
        choices=list(ROUTINGS),
        required=False,
        allow_blank=True,
        default="",
        error_messages={
            "invalid_choice": f"{{input}} is not a way of routing: use {' or '.join(ROUTINGS)}, "
            "or leave it out for prefix"
        },
    )
    profiles = ProfileSerializer(many=True, allow_empty=False)
    adapters = AdapterSerializer(many=True, required=False, default=list, max_length=32)  # type: ignore[call-arg]
    autoscale = AutoscaleSerializer(required=False, allow_null=True, default=None)

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        # "class" is the public field name; it cannot be a Python attribute.
        fields["class"] = serializers.ChoiceField(
            choices=list(CLASSES),
            required=False,
            allow_blank=True,
            default="",
            error_messages={
                "invalid_choice": f"{{input}} is not a class: use one of {', '.join(CLASSES)}, or leave it out for the default"
            },
        )
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        errors: dict[str, list[str]] = {}
        maximum = attrs.get("max_replicas")
        if maximum is not None and attrs["min_replicas"] > maximum:
            errors["max_replicas"] = [
                f"max_replicas ({maximum}) is below min_replicas ({attrs['min_replicas']}); "
                "max is a ceiling, so it must be at least min (or left out to follow min)"
            ]
        mmproj = attrs.get("mmproj") or ""
        if mmproj and attrs["source"].split("?", 1)[0].endswith("/" + mmproj):
            errors["mmproj"] = [
                f"{mmproj!r} is the weights' own file; name the projector, a separate .gguf file "
                "of the same repository"
            ]
        errors.update(_engine_problems(attrs))
        if attrs.get("autoscale"):
            room = autoscale_room(attrs["min_replicas"], attrs.get("max_replicas"))
            if room:
                errors["autoscale"] = [f"{room} (max_replicas)"]
        if attrs["name"] in attrs.get("fallbacks", []):
            errors["fallbacks"] = ["a model cannot fall back to itself"]
        profile_names = [p["name"] for p in attrs["profiles"]]
        if len(set(profile_names)) != len(profile_names):
            errors["profiles"] = ["two profiles have the same name"]
        adapter_names = [a["name"] for a in attrs.get("adapters", [])]
        if len(set(adapter_names)) != len(adapter_names):
            errors["adapters"] = ["two adapters have the same name"]
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


def _names(url: str, file: str) -> bool:
    """Whether the URL's path names `file` (its last part)."""
    return urlsplit(url).path.endswith("/" + file)


def _engine_problems(attrs: dict[str, Any]) -> dict[str, list[str]]:
    """What the definition asks of its engine that the engine does not do (its backend's
    facts: the weights it reads, adapters, projectors, reranking)."""
    engine = get_engine(attrs.get("engine") or DEFAULT_ENGINE)
    files = attrs.get("files") or []
    errors: dict[str, list[str]] = {}
    if len(set(files)) != len(files):
        errors["files"] = ["a file is named twice"]
    if engine.weights_layout == "file":
        if files:
            errors["files"] = [
                f"{engine.name} loads one weights file, the source: leave files out (or use an "
                "engine that loads a snapshot, like vllm)"
            ]
        return errors
    entry = engine.snapshot_entry
    if not _names(attrs["source"], entry):
        errors["source"] = [
            f"{engine.name} loads a Hugging Face snapshot: the source is its {entry} (a URL "
            f"ending in /{entry}), and files lists the snapshot's other files"
        ]
    elif entry in files:
        errors["files"] = [f"{entry} is the source; list the snapshot's other files"]
    if not errors.get("files") and not any(f.endswith(engine.weights_suffix) for f in files):
        errors.setdefault("files", []).append(
            f"{engine.name} needs the weights among the files: at least one "
            f"{engine.weights_suffix} file of the snapshot"
        )
    if attrs.get("mmproj"):
        errors["mmproj"] = [
            f"{engine.name} takes no separate projector file (a vision model's snapshot holds "
            "its own): leave mmproj out"
        ]
    if attrs.get("reranking") and not engine.features.rerank:
        errors["reranking"] = [f"{engine.name} is not run as a reranker by llmgw"]
    folder = engine.adapter_folder
    if folder:
        wrong = [a["name"] for a in attrs.get("adapters", []) if not _names(a["source"], folder[0])]
        if wrong:
            errors["adapters"] = [
                f"{engine.name}'s adapters are folders of {', '.join(folder)}: an adapter's "
                f"source is its {folder[0]} (a URL ending in /{folder[0]}), the rest beside it; "
                f"not so for {', '.join(wrong)}"
            ]
    return errors


def load_definition_text(text: str) -> tuple[Any, dict[Path, int]]:
    """A definition written as YAML, with the line of each field. Text that is not YAML is
    refused with the line of the fault, in the same words by the console, the admin and the
    API (llmgw_site.parsers)."""
    try:
        return load_with_lines(text)
    except YAMLSyntaxError as exc:
        raise Refused(
            f"The definition is not valid YAML: {exc}.",
            code="parse_error",
            problems=[Problem("", str(exc), exc.line)],
        ) from None


def clean_definition(
    data: Any,
    *,
    lines: dict[Path, int] | None = None,
    prefix: Path = (),
    what: str = "The definition",
) -> dict[str, Any]:
    """A validated definition, or a Refused naming every field that is wrong (and its line)."""
    if not isinstance(data, dict):
        raise Refused(
            f"{what} must be a mapping of fields (name, source, profiles, ...), not {type(data).__name__}.",
            code="invalid",
        )
    serializer = ModelDefinitionSerializer(data=data)
    if serializer.is_valid():
        return normalize(dict(serializer.validated_data))
    problems = [
        Problem(path_text(path), message, line_for(lines, (*prefix, *path)) if lines else None)
        for path, message in flatten_errors(serializer.errors)
    ]
    raise invalid(problems, what=what)


def whole_if_possible(value: float) -> float | int:
    """3.0 is stored and shown as 3."""
    return int(value) if float(value).is_integer() else float(value)


def normalize(attrs: dict[str, Any]) -> dict[str, Any]:
    """The validated definition in the form it is stored: plain dicts, whole numbers as ints."""
    attrs["profiles"] = [
        {
            "name": p["name"],
            "memory_gb": whole_if_possible(p["memory_gb"]),
            "cores": whole_if_possible(p["cores"]),
            "gpus": p["gpus"],
            "gpu_memory_gb": whole_if_possible(p["gpu_memory_gb"]),
            # Only when given, so that a definition without it reads back as it was written.
            **({"slots": p["slots"]} if p.get("slots") is not None else {}),
            **({"gpu_layers": p["gpu_layers"]} if p.get("gpu_layers") is not None else {}),
        }
        for p in attrs["profiles"]
    ]
    adapters = []
    for a in attrs.get("adapters", []):
        adapter = {"name": a["name"], "source": a["source"], "scale": whole_if_possible(a["scale"])}
        if a.get("sha256"):
            adapter["sha256"] = a["sha256"]
        adapters.append(adapter)
    attrs["adapters"] = adapters
    attrs["fallbacks"] = list(attrs.get("fallbacks", []))
    attrs["files"] = list(attrs.get("files", []))
    attrs["autoscale"] = dict(attrs["autoscale"]) if attrs.get("autoscale") else None
    return attrs
