"""The fault matrix (tests.support.faults), a sample of its cells per run: a whole llmgw on a
PostgreSQL and a Redis of its own, one part killed or stopped at a random moment of an operation
with traffic through the gateway, and nothing lost once it is back.

The cells are drawn by the seed, printed in each test's id (`seed=N`): LLMGW_FAULT_SEED=N replays a
run, LLMGW_FAULT_CELLS sets how many cells run (2), or names them ("web:add,engine:scale"). The draw
leaves out the cells of faults.KNOWN_FAILING (a cause in the product not fixed yet, said there).
`bench/faults.py` runs every cell. The operations serve, update-fetch, update-roll and canary need
a local registry (git, git-lfs and olah) and are skipped without one; the clock faults need a C
compiler (tests.support.stepclock), and are skipped without one.
Select these with `-m faults`.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
from collections.abc import Iterator

import pytest

from llmgw.engine import find_engine
from tests.support import faults, postgres
from tests.support.registry import available as registry_available

SEED = faults.seed_from_environment()
CELLS = faults.sample_cells(random.Random(SEED), os.environ.get("LLMGW_FAULT_CELLS", "2"))

pytestmark = [
    pytest.mark.faults,
    pytest.mark.engine,
    pytest.mark.skipif(find_engine() is None, reason="llama-server is not built (make setup)"),
    pytest.mark.skipif(not postgres.AVAILABLE, reason="needs PostgreSQL's initdb"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs openai"),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[faults.Fleet]:
    with faults.fleet_in(tmp_path_factory.mktemp("faults")) as running:
        yield running


@pytest.mark.parametrize(
    ("fault", "operation"), CELLS, ids=[f"seed={SEED}-{f}-{o}" for f, o in CELLS]
)
def test_nothing_is_lost_when_a_part_dies_during_an_operation(
    fleet: faults.Fleet, fault: str, operation: str
) -> None:
    if operation in faults.REGISTRY_OPERATIONS and registry_available() is not None:
        pytest.skip(f"{operation} needs a local registry: {registry_available()}")
    if faults.unavailable(fault) is not None:
        pytest.skip(f"{fault}: {faults.unavailable(fault)}")
    print(f"fault matrix seed {SEED} (LLMGW_FAULT_SEED={SEED} replays it)")
    try:
        result = faults.run_cell(fleet, fault, operation, SEED)
        print(result.describe())
        assert result.ok, result.describe() + "\n" + fleet.sys.log_tail(15)
    finally:
        fleet.reset()
