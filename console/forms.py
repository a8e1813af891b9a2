"""The console's forms: they only turn text into values; the services decide what is allowed.

Ranges, ownership and the whole-catalog checks are not repeated here: a form
that checked them too would sooner or later disagree with the API. What a
service refuses comes back through `refuse()`, its message on top of the form
and each problem beside its field.
"""

from __future__ import annotations

import contextlib
from typing import Any

from django import forms
from django.forms.renderers import DjangoTemplates

from catalog.definitions import AdapterSerializer, normalize
from catalog.models import Model
from core.durations import DurationError, parse_duration
from core.refusals import Problem, Refused
from core.serializers import flatten_errors, path_text
from llmgw.engines import DEFAULT_ENGINE, engine_names, get_engine
from registry.api import ServeInput
from registry.updates import GGUF_PATTERN


class ConsoleRenderer(DjangoTemplates):
    """Fields as label, input, errors, help: the errors sit right under what they are about."""

    field_template_name = "console/_field.html"


class ConsoleForm(forms.Form):
    default_renderer = ConsoleRenderer()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("label_suffix", "")
        super().__init__(*args, **kwargs)

    # Problem.field from the services, as it names this form's fields.
    problem_fields: dict[str, str] = {}

    def refuse(self, error: Refused) -> None:
        """Show a service's refusal: its message for the form, each problem at its field."""
        self.add_error(None, error.message)
        for problem in error.problems:
            name = self.problem_fields.get(problem.field, problem.field)
            if name in self.fields:
                self.add_error(name, problem.message)


class ChangeForm(ConsoleForm):
    """A form of a model's page: one change, made by one service.

    `what` names the form (its ids, its partial `<what>-form`); `arguments()` gives
    the cleaned values in the service's own words.
    """

    what = ""

    def __init__(self, *args: Any, model: Model, **kwargs: Any) -> None:
        kwargs.setdefault("auto_id", f"{self.what}-%s")
        super().__init__(*args, **kwargs)
        self.model = model

    def arguments(self) -> dict[str, Any]:
        raise NotImplementedError


def _whole(label: str, example: str) -> dict[str, str]:
    return {"invalid": f"{label} is a whole number, like {example}."}


class ScaleForm(ChangeForm):
    what = "scale"
    problem_fields = {"min": "min", "max": "max"}

    min = forms.IntegerField(
        label="Replicas (min)",
        error_messages={**_whole("The replica count", "2"), "required": "Give the replica count."},
        help_text="How many replicas run. 0 with a max above 0 is on demand; 0 and 0 keeps the model without running it.",
    )
    max = forms.IntegerField(
        label="Ceiling (max)",
        required=False,
        error_messages=_whole("The ceiling", "3"),
        help_text="Left empty, it follows min.",
    )
    idle_timeout = forms.CharField(
        label="Idle timeout",
        required=False,
        max_length=20,
        help_text="For an on-demand model: how long it stays up unasked-for, like 15m. 0 takes the cluster default; empty keeps it.",
    )

    def clean_idle_timeout(self) -> int | None:
        text = self.cleaned_data["idle_timeout"].strip()
        if not text:
            return None
        try:
            return parse_duration(text)
        except DurationError as exc:
            raise forms.ValidationError(str(exc)) from None

    def arguments(self) -> dict[str, Any]:
        data = self.cleaned_data
        return {
            "min_replicas": data["min"],
            "max_replicas": data["max"],
            "idle_timeout": data["idle_timeout"],
        }


class AutoscaleForm(ChangeForm):
    what = "autoscale"
    problem_fields = {"wait": "wait", "up_after": "up_after", "down_after": "down_after"}

    wait = forms.CharField(
        label="Queue wait",
        required=False,
        max_length=20,
        help_text="Keep the wait (p50) for a free slot under this, like 2s. Empty turns autoscaling off.",
    )
    up_after = forms.CharField(
        label="Up after",
        required=False,
        max_length=20,
        help_text="How long the wait stays over it before a replica is added (30s when empty).",
    )
    down_after = forms.CharField(
        label="Down after",
        required=False,
        max_length=20,
        help_text="How long a replica's worth of slots stays unused before one is removed (10m when empty).",
    )

    def arguments(self) -> dict[str, Any]:
        data = {k: v.strip() for k, v in self.cleaned_data.items() if v and v.strip()}
        if "wait" not in data:
            if data:
                raise Refused(
                    "Give the queue wait to turn autoscaling on, or leave every field empty to "
                    "turn it off.",
                    problems=[Problem("wait", "needed with the windows, like 2s")],
                )
            return {"policy": None}
        return {"policy": data}


class ResourcesForm(ChangeForm):
    what = "resources"
    problem_fields = {"memory": "memory_gb", "cores": "cores", "profile": "profile"}

    memory_gb = forms.FloatField(
        label="Memory (GB)",
        error_messages={
            "invalid": "Memory is a number of GB, like 4 or 0.5.",
            "required": "Give the memory a replica reserves, in GB.",
        },
        help_text="Host RAM one replica reserves on its node.",
    )
    cores = forms.FloatField(
        label="Cores",
        required=False,
        error_messages={"invalid": "Cores is a number, like 2."},
        help_text="CPU cores reserved, also the engine's threads. Empty keeps them.",
    )
    profile = forms.ChoiceField(label="Profile", required=False)

    def __init__(self, *args: Any, model: Model, **kwargs: Any) -> None:
        super().__init__(*args, model=model, **kwargs)
        names = [p["name"] for p in model.profiles]
        # Any name is passed on, so that the service's own refusal names the profiles there are.
        self.fields["profile"] = forms.CharField(
            label="Profile",
            required=False,
            widget=forms.Select(choices=[("", "every profile"), *[(n, n) for n in names]]),
            help_text="Replicas already running keep what they reserved until they are replaced.",
        )

    def arguments(self) -> dict[str, Any]:
        data = self.cleaned_data
        # An empty profile is every profile.
        return {**data, "profile": data["profile"] or None}


class ClassForm(ChangeForm):
    what = "class"
    problem_fields = {"class": "class"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "class" is the field's public name (as in the YAML and the API).
        self.fields["class"] = forms.CharField(
            label="Class",
            required=False,
            widget=forms.Select(
                choices=[
                    ("default", "default"),
                    ("critical", "critical"),
                    ("standard", "standard"),
                    ("opportunistic", "opportunistic"),
                ]
            ),
            help_text="Critical keeps its minimum and may preempt others; standard gives way to "
            "critical; opportunistic to both. Default: opportunistic on demand, standard otherwise.",
        )

    def arguments(self) -> dict[str, Any]:
        return {"klass": self.cleaned_data["class"]}


class OwnerForm(ChangeForm):
    what = "owner"
    problem_fields = {"owner": "owner"}

    owner = forms.CharField(
        label="New owner",
        max_length=150,
        error_messages={"required": "Give the username of the new owner."},
        help_text="Only the new owner and staff can change the model afterwards.",
    )

    def arguments(self) -> dict[str, Any]:
        return {"username": self.cleaned_data["owner"].strip()}


class AdaptersForm(ChangeForm):
    what = "adapters"
    problem_fields = {"remove": "remove", "add": "name"}

    name = forms.CharField(label="Adapter name", required=False, max_length=100)
    source = forms.CharField(label="Source URL", required=False, max_length=2000)
    scale = forms.CharField(
        label="Scale",
        required=False,
        max_length=20,
        help_text=(
            "1 when empty; from 0 to 10. A request for this adapter gets it at this scale (the "
            "gateway asks the engine for it per request), and the base model's requests at 0."
        ),
    )
    sha256 = forms.CharField(label="sha256", required=False, max_length=64)
    skip_source_check = forms.BooleanField(
        label="Skip the source check",
        required=False,
        help_text="Right when the mirror is not up yet, or nodes reach it by an address the control plane does not.",
    )

    def __init__(self, *args: Any, model: Model, **kwargs: Any) -> None:
        super().__init__(*args, model=model, **kwargs)
        names = [a["name"] for a in model.adapters]
        # Any name is passed on, so that the service's own refusal lists the adapters there are.
        self.fields["remove"] = forms.MultipleChoiceField(
            label="Remove",
            required=False,
            choices=[(n, n) for n in names],
            widget=forms.CheckboxSelectMultiple,
        )
        self.fields["remove"].valid_value = lambda value: True  # type: ignore[attr-defined]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        wanted = {k: data.get(k) for k in ("name", "source", "scale", "sha256") if data.get(k)}
        data["add"] = []
        if not wanted:
            if not data.get("remove") and not self.errors:
                raise forms.ValidationError(
                    "Nothing to change: name an adapter to add, or tick one to remove."
                )
            return data
        # A form sends text; the API's schema takes a number, as a YAML or JSON client sends it.
        scale = wanted.get("scale")
        if isinstance(scale, str):
            with contextlib.suppress(ValueError):  # else refused below, in the API's words
                wanted["scale"] = float(scale)
        # The API's own adapter schema, so that the console refuses what the API refuses.
        serializer = AdapterSerializer(data=wanted)
        if not serializer.is_valid():
            for path, message in flatten_errors(serializer.errors):
                field = str(path[0]) if path else ""
                if field in self.fields:
                    self.add_error(field, message)
                else:
                    self.add_error(None, f"{path_text(path)}: {message}")
            return data
        data["add"] = normalize({"profiles": [], "adapters": [serializer.validated_data]})[
            "adapters"
        ]
        return data

    def arguments(self) -> dict[str, Any]:
        data = self.cleaned_data
        return {
            "add": data["add"],
            "remove": list(data.get("remove") or []),
            "source_check": not data["skip_source_check"],
        }


class AddModelForm(ConsoleForm):
    definition = forms.CharField(
        label="Definition (YAML)",
        widget=forms.Textarea(attrs={"rows": 18, "spellcheck": "false", "class": "code"}),
        error_messages={"required": "Paste a model definition: the YAML of one models: entry."},
    )
    skip_source_check = forms.BooleanField(
        label="Skip the source check",
        required=False,
        help_text="The control plane otherwise asks the source URL whether the weights are there "
        "before adding the model. Skip it when the mirror is not up yet, or nodes reach it by an "
        "address the control plane does not.",
    )


def _engine_choice(name: str) -> str:
    """An engine as the serve form offers it: its name and what it loads."""
    if get_engine(name).weights_layout == "snapshot":
        return f"{name}: a Hugging Face snapshot (config, tokenizer, safetensors)"
    return f"{name}: one GGUF file"


class ServeForm(ConsoleForm):
    """`llmgw ctl model serve` as a form; the API's own input schema has the last word."""

    # The API's names for the fields whose names differ here.
    api_names = {"branch": "revision"}

    repo = forms.CharField(
        label="Repository",
        max_length=200,
        widget=forms.TextInput(attrs={"placeholder": "ORG/NAME", "spellcheck": "false"}),
        error_messages={"required": "Give the repository, as ORG/NAME."},
    )
    engine = forms.ChoiceField(
        label="Engine",
        required=False,
        choices=[
            ("" if name == DEFAULT_ENGINE else name, _engine_choice(name))
            for name in sorted(engine_names(), key=lambda name: name != DEFAULT_ENGINE)
        ],
        help_text="What runs the model. Its node must have it installed.",
    )
    file = forms.CharField(
        label="File pattern",
        required=False,
        max_length=500,
        initial=GGUF_PATTERN,
        widget=forms.TextInput(attrs={"spellcheck": "false"}),
        help_text="A glob that picks exactly one GGUF file of the repository, like *q4_k_m.gguf. "
        "For a snapshot: globs separated by commas; left as *.gguf or empty, its config, "
        "tokenizer and safetensors files.",
    )
    branch = forms.CharField(
        label="Branch",
        required=False,
        max_length=200,
        initial="main",
        help_text="The model follows it: a newer commit that changes its file is an update.",
    )
    name = forms.CharField(
        label="Name",
        required=False,
        max_length=100,
        help_text="Empty: the file's name without .gguf.",
    )
    mmproj = forms.CharField(
        label="Vision projector",
        required=False,
        max_length=500,
        widget=forms.TextInput(attrs={"spellcheck": "false"}),
        help_text="The projector's path in the repository, like mmproj-model-f16.gguf: fetched "
        "with the weights, so that the model takes images. Empty: none.",
    )
    memory_gb = forms.FloatField(
        label="Memory (GB)",
        required=False,
        error_messages={"invalid": "Memory is a number of GB, like 4 or 0.5."},
        help_text="Host RAM one replica reserves. Empty: 1.25 times the file's size plus 0.5 GB, at least 1.",
    )
    cores = forms.FloatField(
        label="Cores",
        required=False,
        error_messages={"invalid": "Cores is a number, like 2."},
        help_text="CPU cores reserved, also the engine's threads. Empty: 1.",
    )
    min = forms.IntegerField(
        label="Replicas (min)",
        required=False,
        initial=1,
        error_messages=_whole("The replica count", "2"),
        help_text="Empty: 1. 0 with a max above 0 is on demand.",
    )
    max = forms.IntegerField(
        label="Ceiling (max)",
        required=False,
        error_messages=_whole("The ceiling", "3"),
        help_text="Left empty, it follows min.",
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        engine = data["engine"] or ""
        pattern = data["file"].strip()
        if (
            pattern == GGUF_PATTERN
            and get_engine(engine or DEFAULT_ENGINE).weights_layout == "snapshot"
        ):
            pattern = ""  # the field's first value, left as it is: the engine's own set
        wanted = {
            "repo": data["repo"].strip(),
            "file": pattern or None,  # the default, serve_start's
            **({"engine": engine} if engine else {}),
            "revision": data["branch"].strip() or "main",
            "name": data["name"].strip() or None,
            # Left out when empty: the API takes no empty name.
            **({"mmproj": data["mmproj"].strip()} if data["mmproj"].strip() else {}),
            "memory_gb": data["memory_gb"],
            "cores": data["cores"],
            "min": 1 if data["min"] is None else data["min"],
            "max": data["max"],
        }
        serializer = ServeInput(data=wanted)
        if not serializer.is_valid():
            fields = {api: mine for mine, api in self.api_names.items()}
            for path, message in flatten_errors(serializer.errors):
                field = fields.get(str(path[0]), str(path[0])) if path else ""
                if field in self.fields:
                    self.add_error(field, message)
                else:
                    self.add_error(None, f"{path_text(path)}: {message}")
            return data
        data["serve"] = serializer.validated_data
        return data
