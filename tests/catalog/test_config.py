"""server.yaml: cluster settings, declared models applied on start, and errors that stop the start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from catalog.config import ConfigError, load_config, parse_config
from catalog.models import AuditEntry, Model
from llmgw_site.startup import apply_config_on_start
from tests.factories import definition

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]


def test_defaults_apply_when_the_file_is_missing(tmp_path: Path) -> None:
    config = load_config(tmp_path / "absent.yaml")
    assert (config.update_check, config.reconcile_interval, config.default_idle_timeout) == (
        21600,
        5,
        900,
    )
    assert config.models == []


def test_cluster_settings_are_read(tmp_path: Path) -> None:
    text = "cluster: {reconcile_interval: 10s, default_idle_timeout: 1h}\nmirror: {update_check: 30m}\nregistry: {endpoint: 'http://127.0.0.1:9000'}\n"
    config = parse_config(text, tmp_path / "server.yaml")
    assert (config.reconcile_interval, config.default_idle_timeout, config.update_check) == (
        10,
        3600,
        1800,
    )
    assert config.registry_endpoint == "http://127.0.0.1:9000"


def test_a_registry_named_in_the_file_is_known_to_be_named_even_hugging_face(
    tmp_path: Path,
) -> None:
    path = tmp_path / "server.yaml"
    config = parse_config("registry: {endpoint: 'https://huggingface.co'}\n", path)
    assert config.registry_endpoint == "https://huggingface.co"
    assert config.registry_named_by == f"registry.endpoint in {path}"


def test_no_registry_named_leaves_the_default_unnamed(tmp_path: Path) -> None:
    config = parse_config("registry: {token: abc}\n", tmp_path / "server.yaml")
    assert (config.registry_endpoint, config.registry_named_by) == ("https://huggingface.co", "")


def test_the_environment_names_the_registry_over_the_file(tmp_path: Path, settings: Any) -> None:
    settings.LLMGW_REGISTRY_ENDPOINT = "https://huggingface.co"
    config = parse_config("registry: {endpoint: 'http://127.0.0.1:9000'}\n", tmp_path / "s.yaml")
    assert (config.registry_endpoint, config.registry_named_by) == (
        "https://huggingface.co",
        "LLMGW_REGISTRY_ENDPOINT",
    )


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "mirror: {update_chek: 1h}\n",
            "server.yaml: mirror.update_chek: unknown field; did you mean 'update_check'? (line 1)",
        ),
        ("colors: red\n", "server.yaml: colors: unknown field"),
        (
            "models:\n  - name: a\n    source: http://h/a.gguf\n    profiles:\n      - name: cpu\n        memory_gb: -1\n",
            "server.yaml: models[0] (a): profiles[0].memory_gb: must not be negative (line 6)",
        ),
        (
            "models:\n  - name: a\n    source: http://h/a.gguf\n    profiles: [{name: cpu, memory_gb: 1}]\n    min_replica: 2\n",
            "server.yaml: models[0] (a): min_replica: unknown field; did you mean 'min_replicas'? (line 5)",
        ),
        ("models: [\n", "server.yaml: the YAML could not be read on line 2"),
        ("- 1\n", "server.yaml: the file must be a mapping"),
    ],
)
def test_errors_name_the_file_the_entry_and_the_field(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, tmp_path / "server.yaml")
    assert message in str(caught.value)


def test_declared_models_are_created_updated_and_removed_on_start(server_yaml: Any) -> None:
    server_yaml({"models": [definition("a", owner="dora"), definition("b", fallbacks=["a"])]})
    apply_config_on_start("web")
    assert {m.name: m.declared for m in Model.objects.all()} == {"a": True, "b": True}
    assert Model.objects.get(name="a").owner.username == "dora"
    assert [(e.actor_name, e.door, e.action) for e in AuditEntry.objects.order_by("id")] == [
        ("config", "config", "add"),
        ("config", "config", "add"),
    ]

    apply_config_on_start("worker")  # unchanged: nothing written
    assert AuditEntry.objects.count() == 2

    server_yaml({"models": [definition("a", min_replicas=3)]})
    apply_config_on_start("beat")
    assert list(Model.objects.values_list("name", "min_replicas")) == [("a", 3)]
    assert AuditEntry.objects.filter(action="remove", model_name="b").exists()
    update = AuditEntry.objects.get(action="update")
    assert update.changes["min_replicas"] == [1, 3]


def test_a_bad_file_stops_the_start_and_changes_nothing(server_yaml: Any, capsys: Any) -> None:
    server_yaml({"models": [definition("a")]})
    apply_config_on_start("web")
    server_yaml({"models": [definition("a", fallbacks=["b"]), definition("b", fallbacks=["a"])]})
    with pytest.raises(SystemExit):
        apply_config_on_start("web")
    assert "the fallbacks form a loop (a -> b -> a)" in capsys.readouterr().err
    assert list(Model.objects.values_list("name", "fallbacks")) == [("a", [])]


def test_a_declared_name_taken_at_runtime_stops_the_start(
    server_yaml: Any, api: Any, capsys: Any
) -> None:
    api("alice").post("/api/v1/models?source_check=false", definition("a"), format="json")
    server_yaml({"models": [definition("a")]})
    with pytest.raises(SystemExit):
        apply_config_on_start("web")
    assert (
        "a is declared in the file, but a model of that name was added at runtime (owner alice)"
        in capsys.readouterr().err
    )


def test_declared_models_refuse_remove_and_scale_saying_why(server_yaml: Any, api: Any) -> None:
    path = server_yaml({"models": [definition("a")]})
    apply_config_on_start("web")
    response = api("staff").delete("/api/v1/models/a")
    assert response.status_code == 409
    assert response.json()["detail"] == (
        f"a is declared in {path}, which is read again on every start, so removing it here would only "
        f"last until then: it would come back. Change it in {path} instead."
    )
    response = api("staff").post("/api/v1/models/a/scale", {"min": 3}, format="json")
    assert response.status_code == 409
    assert "so a scale set here would revert then" in response.json()["detail"]
    assert Model.objects.get().min_replicas == 1


def test_a_bad_file_stops_a_real_worker_start(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("mirror: {update_check: often}\n")
    env = {
        "LLMGW_CONFIG": str(config),
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        "PATH": "/usr/bin:/bin",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE','llmgw_site.settings'); "
            "django.setup(); from llmgw_site.startup import apply_config_on_start; apply_config_on_start('worker')",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 2
    assert (
        f"llmgw worker: cannot start: {config}: mirror.update_check: 'often' is not a duration"
        in result.stderr
    )


@pytest.mark.parametrize(
    "text, message",
    [
        (
            'a0: &a0 "lol"\n'
            + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10))
            + "models: *a9\n",
            "the YAML was refused on line 6: through its anchors and aliases it expands to "
            "more than 100,000 values",
        ),
        (
            "cluster:\n  reconcile_interval: 5s\ncluster:\n  node_lost_after: 1m\n",
            "the YAML was refused on line 3: the key 'cluster' is given twice in one mapping "
            "(lines 1 and 3); keep one of them",
        ),
        (
            "models:\n  - name: a\n    min_replicas: " + "9" * 5000 + "\n",
            "the YAML was refused on line 3: a number with 5000 digits is larger than any field "
            "takes (at most 40)",
        ),
        (
            "models:\n  - name: a\n    description: " + "[" * 5000 + "]" * 5000 + "\n",
            "the YAML was refused on line 3: it is nested more than 32 levels deep",
        ),
        (
            "cluster:\n  reconcile_interval: " + "9" * 5000 + "s\n",
            "cluster.reconcile_interval: '" + "9" * 20 + "…(5001 characters)' is not a duration",
        ),
    ],
    ids=["alias-bomb", "duplicate-key", "huge-integer", "deep-nesting", "huge-duration"],
)
def test_a_hostile_file_stops_the_start_with_file_and_line(
    server_yaml: Any, capsys: Any, text: str, message: str
) -> None:
    path = server_yaml(text)
    with pytest.raises(SystemExit) as stopped:
        apply_config_on_start("web")
    assert stopped.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith(f"llmgw web: cannot start: {path}: ")
    assert message in err
    assert "Traceback" not in err
    assert Model.objects.count() == 0


def test_a_file_that_is_not_utf8_stops_the_start(server_yaml: Any, capsys: Any) -> None:
    path = server_yaml("")
    path.write_bytes(b"cluster: \xff\n")
    with pytest.raises(SystemExit):
        apply_config_on_start("web")
    assert f"llmgw web: cannot start: {path}: is not UTF-8 text (byte 9)" in capsys.readouterr().err
