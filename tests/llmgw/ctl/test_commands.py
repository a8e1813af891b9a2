"""`llmgw ctl` against a running server (pytest-django's live server): every command and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from catalog.models import AuditEntry, Model
from llmgw.cli import main
from tests.factories import definition
from tests.support.ctl import Ctl, ctl_as

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


@pytest.fixture
def model_file(tmp_path: Path) -> Any:
    def write(**overrides: Any) -> str:
        path = tmp_path / f"{overrides.get('name', 'tiny-chat')}.yaml"
        path.write_text(yaml.safe_dump(definition(**overrides), sort_keys=False))
        return str(path)

    return write


def test_add_then_list(ctl: Any, model_file: Any) -> None:
    code, out, err = ctl(
        "alice", "model", "add", "-f", model_file(max_replicas=3), "--no-source-check"
    )
    assert code == 0, err
    assert "tiny-chat added, owned by alice; class standard; replicas 1 (max 3)." in out
    assert "watch it with: llmgw ctl models" in out
    code, out, _ = ctl("bob", "models")
    assert code == 0
    header, row = out.strip().splitlines()
    assert header.split() == ["NAME", "READY", "KIND", "OWNER", "CLASS", "SCALING", "NOTE"]
    assert row.split()[:6] == ["tiny-chat", "0/1", "runtime", "alice", "standard", "1"]
    code, out, _ = ctl("bob", "models", "--json")
    assert json.loads(out)[0]["definition"]["max_replicas"] == 3


def test_add_prints_the_servers_refusal_and_exits_non_zero(ctl: Any, model_file: Any) -> None:
    code, out, err = ctl(
        "alice",
        "model",
        "add",
        "-f",
        model_file(min_replicas=-1, min_replica=2),
        "--no-source-check",
    )
    assert code == 1 and out == ""
    assert "The definition was refused, nothing was changed" in err
    assert "line 4: min_replicas: must not be negative" in err
    assert "min_replica: unknown field; did you mean 'min_replicas'?" in err
    assert Model.objects.count() == 0


def test_add_runs_the_source_check_by_default(ctl: Any, model_file: Any, settings: Any) -> None:
    settings.LLMGW_SOURCE_ALLOWED_HOSTS = ["127.0.0.1:9"]
    code, _, err = ctl(
        "alice", "model", "add", "-f", model_file(source="http://127.0.0.1:9/x.gguf")
    )
    assert code == 1
    assert "could not be reached" in err and "--no-source-check" in err


def test_a_missing_file_is_one_clear_line(ctl: Any, tmp_path: Path) -> None:
    code, _, err = ctl("alice", "model", "add", "-f", str(tmp_path / "nope.yaml"))
    assert code == 1
    assert err.strip() == f"error: cannot read {tmp_path / 'nope.yaml'}: No such file or directory"


def test_scale_prints_what_is_in_force(ctl: Any, model_file: Any) -> None:
    ctl("alice", "model", "add", "-f", model_file(), "--no-source-check")
    code, out, _ = ctl("alice", "scale", "tiny-chat", "--min", "2")
    assert code == 0
    assert out.startswith(
        "tiny-chat: 2 replica(s) (max 2, following min). It takes effect on the next pass."
    )
    code, out, _ = ctl(
        "alice", "scale", "tiny-chat", "--min", "0", "--max", "3", "--idle-timeout", "10m"
    )
    assert out.startswith(
        "tiny-chat is on demand: one replica is loaded when asked for (max 3), and stopped after 10m"
    )
    code, out, _ = ctl("alice", "scale", "tiny-chat", "--min", "0", "--max", "0")
    assert out.startswith("tiny-chat will not be placed; it stays in the catalog")
    code, _, err = ctl("bob", "scale", "tiny-chat", "--min", "1")
    assert (
        code == 1 and "tiny-chat belongs to alice; only they or a staff user may change it." in err
    )


def test_scale_of_a_declared_model_says_to_edit_the_file(ctl: Any, server_yaml: Any) -> None:
    from llmgw_site.startup import apply_config_on_start

    path = server_yaml({"models": [definition("declared-one")]})
    apply_config_on_start("web")
    code, _, err = ctl("staff", "scale", "declared-one", "--min", "2")
    assert code == 1
    assert f"declared-one is declared in {path}" in err and f"Change it in {path} instead." in err
    code, _, err = ctl("staff", "model", "remove", "declared-one")
    assert code == 1 and "it would come back" in err


def test_resources_class_owner_and_remove(ctl: Any, model_file: Any) -> None:
    ctl("alice", "model", "add", "-f", model_file(), "--no-source-check")
    code, out, _ = ctl("alice", "model", "resources", "tiny-chat", "--memory", "3", "--cores", "2")
    assert code == 0
    assert out.splitlines() == [
        "tiny-chat/cpu: 3 GB memory, 2 cores, 0 GPUs",
        "Running replicas keep their old figures until restarted: llmgw ctl restart --model tiny-chat",
    ]
    code, out, _ = ctl("alice", "model", "class", "tiny-chat", "critical")
    assert out.strip() == "tiny-chat is critical (set explicitly). It applies from the next pass."
    code, out, _ = ctl("alice", "model", "class", "tiny-chat", "default")
    assert (
        out.strip()
        == "tiny-chat is standard (the default for its scaling). It applies from the next pass."
    )
    code, out, _ = ctl("alice", "model", "owner", "tiny-chat", "bob")
    assert out.strip() == "tiny-chat is now owned by bob."
    code, _, err = ctl("alice", "model", "remove", "tiny-chat")
    assert code == 1 and "tiny-chat belongs to bob" in err
    code, out, _ = ctl("bob", "model", "remove", "tiny-chat")
    assert code == 0 and out.startswith("tiny-chat removed.")
    assert not Model.objects.exists()


def test_adapters_from_the_command_line(ctl: Any, model_file: Any) -> None:
    ctl("alice", "model", "add", "-f", model_file(), "--no-source-check")
    code, out, err = ctl(
        "alice",
        "model",
        "adapters",
        "tiny-chat",
        "--add",
        "tiny-sql=http://127.0.0.1:8000/sql.gguf@0.5",
        "--no-source-check",
    )
    assert code == 0, err
    assert out.splitlines()[0] == "tiny-sql\tscale 0.5\thttp://127.0.0.1:8000/sql.gguf"
    assert "replicas load them when restarted: llmgw ctl restart --model tiny-chat" in out
    code, out, _ = ctl("carol", "model", "adapters", "tiny-chat", "--json")
    assert json.loads(out) == [
        {"name": "tiny-sql", "source": "http://127.0.0.1:8000/sql.gguf", "scale": 0.5}
    ]
    code, _, err = ctl("alice", "model", "adapters", "tiny-chat", "--add", "broken")
    assert code == 1 and "--add 'broken' is not NAME=URL[@SCALE]" in err


def test_audit_shows_who_did_what_through_the_cli(ctl: Any, model_file: Any) -> None:
    ctl("alice", "model", "add", "-f", model_file(), "--no-source-check")
    ctl("alice", "scale", "tiny-chat", "--min", "3")
    code, out, _ = ctl("carol", "audit", "--model", "tiny-chat")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split() == ["WHEN", "(UTC)", "ACTOR", "DOOR", "ACTION", "MODEL", "CHANGE"]
    assert (
        lines[1].split()[2:]
        == [
            "alice",
            "cli",
            "scale",
            "tiny-chat",
            "min_replicas:",
            "1",
            "->",
            "3,",
            "max_replicas:",
            "null",
            "->",
            "null",
        ]
        or "min_replicas: 1 -> 3" in lines[1]
    )
    assert "add" in lines[2]
    code, out, _ = ctl("carol", "audit", "--actor", "alice", "--json")
    assert [e["door"] for e in json.loads(out)] == ["cli", "cli"]
    assert AuditEntry.objects.filter(door="cli").count() == 2


def test_show_prints_yaml_that_adds_back(ctl: Any, model_file: Any, tmp_path: Path) -> None:
    ctl("alice", "model", "add", "-f", model_file(idle_timeout="20m"), "--no-source-check")
    code, out, _ = ctl("alice", "model", "show", "tiny-chat")
    copied = yaml.safe_load(out)
    assert copied["idle_timeout"] == "20m"
    ctl("alice", "model", "remove", "tiny-chat")
    path = tmp_path / "copied.yaml"
    path.write_text(out)
    code, _, err = ctl("alice", "model", "add", "-f", str(path), "--no-source-check")
    assert code == 0, err


def test_an_unreachable_control_plane_is_one_line(capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("LLMGW_URL", "http://127.0.0.1:9")
    assert main(["ctl", "models"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == "error: cannot reach the control plane at http://127.0.0.1:9: nothing answered there. Is it running? Set LLMGW_URL to its address.\n"
    )


def test_a_bad_token_is_one_line(live_server: Any, capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("LLMGW_URL", live_server.url)
    monkeypatch.setenv("LLMGW_TOKEN", "wrong")
    assert main(["ctl", "models"]) == 1
    assert "Invalid token. Check LLMGW_TOKEN" in capsys.readouterr().err


def test_the_installed_command_runs(live_server: Any, tokens: dict[str, str]) -> None:
    env = {"LLMGW_URL": live_server.url, "LLMGW_TOKEN": tokens["alice"], "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "ctl", "models", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    help_text = subprocess.run(
        [sys.executable, "-m", "llmgw", "ctl", "scale", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "--max is a ceiling, not a target" in help_text
    assert "on demand" in help_text


def test_the_cli_imports_no_django() -> None:
    code = "import sys, llmgw.cli, llmgw.ctl, llmgw.client; sys.exit(1 if any(m.startswith('django') for m in sys.modules) else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_nodes_from_the_command_line(ctl: Any) -> None:
    code, out, _ = ctl("staff", "node", "add", "gpu-1")
    assert code == 0
    token = out.split("shown only now:")[1].split()[0]
    assert token.startswith("llmgw-node-")
    assert "llmgw node --server http://localhost:" in out or "llmgw node --server" in out
    code, out, _ = ctl("alice", "nodes")
    assert out.splitlines()[1].split()[:2] == ["gpu-1", "waiting"]
    code, out, _ = ctl("staff", "node", "cordon", "gpu-1")
    assert out.strip() == "Node gpu-1 is cordoned: it keeps its replicas but gets no new ones."
    code, _, err = ctl("alice", "node", "uncordon", "gpu-1")
    assert code == 1 and "Only staff may cordon nodes" in err
    code, out, _ = ctl("staff", "node", "remove", "gpu-1")
    assert out.startswith("Node gpu-1 removed")
    assert "agent, at its next heartbeat, stops its engines and exits (status 78" in out
    code, out, _ = ctl("alice", "nodes", "--json")
    assert json.loads(out) == []


def test_restart_target_and_plan_from_the_command_line(ctl: Any, model_file: Any) -> None:
    ctl("staff", "node", "add", "small")
    ctl(
        "alice",
        "model",
        "add",
        "-f",
        model_file(profiles=[{"name": "cpu", "memory_gb": 24}]),
        "--no-source-check",
    )
    code, out, _ = ctl("alice", "restart", "--model", "tiny-chat")
    assert code == 0 and "one replica at a time" in out and "generation 1" in out
    code, out, _ = ctl("bob", "model", "target", "tiny-chat")
    assert (
        out.splitlines()[0] == "tiny-chat: 0 ready of 1 wanted (min_replicas is 1); class standard"
    )
    assert "1 not placed: no schedulable nodes" in out
    code, out, _ = ctl("bob", "model", "target", "tiny-chat", "--json")
    assert json.loads(out)["desired"] == 1
    code, out, _ = ctl("bob", "model", "plan", "-f", model_file(name="other"))
    assert out.splitlines()[0] == "other: 1 replica(s) wanted (nothing is changed by this plan)"
    assert "could not be placed: no schedulable nodes" in out
    code, _, err = ctl("bob", "model", "plan")
    assert code == 1 and "give a model's name, or -f FILE" in err


def test_autoscale_on_refused_on_and_off(ctl: Any, model_file: Any) -> None:
    ctl("alice", "model", "add", "-f", model_file(), "--no-source-check")
    code, _, err = ctl("alice", "model", "autoscale", "tiny-chat", "--wait", "2s")
    assert code == 1
    assert "with min 1 and no max there is no room to scale: set a max above 1 first" in err
    code, _, err = ctl("alice", "model", "autoscale", "tiny-chat")
    assert code == 1 and "give --wait (like 2s) to turn the policy on, or --off" in err
    ctl("alice", "scale", "tiny-chat", "--min", "1", "--max", "4")
    code, out, _ = ctl(
        "alice", "model", "autoscale", "tiny-chat", "--wait", "2s", "--up-after", "1m"
    )
    assert code == 0
    assert out.splitlines()[0] == (
        "tiny-chat: autoscaling between 1 and 4 replicas, to keep its queue wait under 2s "
        "(up after 1m, down after 10m). It applies from the next pass."
    )
    code, out, _ = ctl("alice", "model", "show", "tiny-chat")
    assert "autoscale:\n  wait: 2s\n  up_after: 1m\n  down_after: 10m" in out
    code, out, _ = ctl("alice", "model", "target", "tiny-chat", "--json")
    target = json.loads(out)
    assert target["autoscale"]["wait"] == "2s" and target["why"].startswith("autoscaled: ")
    code, _, err = ctl("alice", "model", "autoscale", "tiny-chat", "--wait", "0s")
    assert code == 1 and "must be from 1s to 10m" in err
    code, out, _ = ctl("alice", "model", "autoscale", "tiny-chat", "--off")
    assert code == 0 and out.strip() == "tiny-chat: autoscaling off; it runs 1 (max 4)."
