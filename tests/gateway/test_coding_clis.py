"""End to end: the coding CLIs people point at llmgw, OpenAI's Codex (the Responses API) and
Anthropic's Claude Code (the Messages API), each completing one turn through the gateway of a whole
llmgw serving a tiny model on the real llama.cpp server, set up as docs/sharing.md says, with a
gateway key and nothing leaving the machine; and the gateway's usage counting the turn against
the key.

The CLIs are the versions scripts/system-deps pins (`make test` installs them first). Their
prompts are large: Codex sends about 20,000 characters of instructions and tools, Claude Code
about 50,000, which the tiny model's small vocabulary makes about 16,800 and 14,200 tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support.clis import (
    claude_environment,
    codex_environment,
    documented_claude,
    find_cli,
    run_cli,
)
from tests.support.http_files import serve_directory
from tests.support.system import System, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
]

# The model docs/sharing.md sets the CLIs up for.
MODEL = "coder"
# The docs' context: the CLIs' prompts and a random answer (a few hundred tokens, see SEED) fit.
# The engine's memory for it is small: 256 bytes a token of the tiny model, 8 MiB.
CONTEXT_LENGTH = 32768
# The random model writes until it happens on its end-of-text token (a CLI asks for up to 32,000
# tokens), and that chance depends on the weights: over 12 answers each, seed 1 wrote 406 tokens
# on average (up to 1,499), seed 3 162 (up to 738).
SEED = 3
# The CLIs' own prompt alone is thousands of tokens: a figure below this was not their turn.
LEAST_PROMPT_TOKENS = 5000
# Measured on 2 cores (2026-12-07): a turn took 4 to 40 s, reading the prompt (7,000 tokens a
# second on an idle machine, 1,200 to 1,700 beside other tests) and writing the answer (15 to 65
# tokens a second beside a prompt this long).
TURN_TIMEOUT = 300


def cli(name: str) -> Path:
    executable = find_cli(name)
    if executable is None:
        pytest.skip(
            f"{name} is not installed: `scripts/system-deps clis` installs it (make test does)"
        )
    return executable


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("weights")
    # The model's own context must hold the CLIs' prompts too (llama.cpp warns past it).
    write_tiny_model(folder / "tiny.gguf", seed=SEED, context_length=CONTEXT_LENGTH)
    with serve_directory(folder) as (base_url, _stats):
        yield base_url


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, weights: str) -> Iterator[System]:
    running = System(tmp_path_factory.mktemp("system"), allowed_hosts=[urlsplit(weights).netloc])
    with running.running():
        running.add_ready_nodes(memory_gb=4, cores=2, names=("node-a",))
        running.api(
            "POST",
            "models",
            json={
                "name": MODEL,
                "source": f"{weights}/tiny.gguf",
                # Both cores: reading a CLI's prompt is a good part of a turn.
                "profiles": [{"name": "cpu", "memory_gb": 1, "cores": 2}],
                "context_length": CONTEXT_LENGTH,
            },
        )
        wait_for(
            lambda: any(
                replica["routable"]
                for replica in running.api("GET", f"models/{MODEL}/target")["replicas"]
            ),
            timeout=90,
            what=f"a ready replica of {MODEL}",
        )
        yield running


def new_key(system: System, name: str) -> tuple[int, str]:
    made = system.api("POST", "keys", json={"name": name})
    return made["id"], made["key"]


def usage(system: System, key_id: int) -> dict[str, Any]:
    """The key's requests and tokens as `llmgw ctl usage --key ID` reads them, summed."""
    rows = system.api("GET", "usage", params={"key": key_id})
    return {
        "models": sorted({row["model"] for row in rows}),
        **{
            field: sum(row[field] for row in rows)
            for field in ("requests", "prompt_tokens", "completion_tokens")
        },
    }


def assert_turn_counted(system: System, key_id: int) -> dict[str, Any]:
    # The gateway writes its figures every few seconds.
    counted = wait_for(
        lambda: (found := usage(system, key_id))["requests"] and found,
        timeout=30,
        what=f"key {key_id}'s usage to be written",
    )
    assert counted["models"] == [MODEL], counted
    assert counted["prompt_tokens"] >= LEAST_PROMPT_TOKENS, counted
    assert counted["completion_tokens"] >= 1, counted
    return counted


def test_codex_completes_a_turn_through_the_responses_api(system: System, tmp_path: Path) -> None:
    codex = cli("codex")
    key_id, key = new_key(system, "codex")
    assert usage(system, key_id)["requests"] == 0
    (tmp_path / "work").mkdir()

    run = run_cli(
        [str(codex), "exec", "--skip-git-repo-check", "Say hello."],
        env=codex_environment(tmp_path / "home", url=system.url, key=key),
        cwd=tmp_path / "work",
        timeout=TURN_TIMEOUT,
    )

    assert run.returncode == 0, run
    assert "provider: llmgw\n" in run.stderr and f"model: {MODEL}\n" in run.stderr, run
    assert run.stdout.strip(), run  # the model's answer: random text
    print(f"codex: a turn in {run.seconds:.1f} s,", assert_turn_counted(system, key_id))


@pytest.mark.parametrize("api_key", [False, True], ids=["auth-token", "api-key"])
def test_claude_code_completes_a_turn_through_the_messages_api(
    system: System, tmp_path: Path, api_key: bool
) -> None:
    """The key as ANTHROPIC_AUTH_TOKEN, sent as Authorization: Bearer (the docs' way), and as
    ANTHROPIC_API_KEY, sent as x-api-key: the gateway takes it from either."""
    claude = cli("claude")
    variables, command = documented_claude()
    assert command == ["claude", "--model", MODEL]
    assert variables["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(CONTEXT_LENGTH)
    key_id, key = new_key(system, "claude-x-api-key" if api_key else "claude-bearer")
    (tmp_path / "work").mkdir()

    run = run_cli(
        [str(claude), "-p", "Say hello.", *command[1:]],
        env=claude_environment(tmp_path / "home", url=system.url, key=key, api_key=api_key),
        cwd=tmp_path / "work",
        timeout=TURN_TIMEOUT,
    )

    assert run.returncode == 0, run
    assert run.stdout.strip(), run
    print(f"claude: a turn in {run.seconds:.1f} s,", assert_turn_counted(system, key_id))
