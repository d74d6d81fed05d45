"""DDP's own scaling, bit for bit, at a world size of 3 (real gloo ranks): DDP divides some
gradients and multiplies others by the reciprocal, by a divisor that Join may change; a divide
and a multiply by 1/3 differ in the last bit, so ddpdoctor's comm hook must make the same choice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ddpdoctor
from tests.ddp_harness import run_ranks
from tests.divisor_workers import CASES, PYTHON_ROUTE, divisor_runs

pytestmark = pytest.mark.torch_compat

WORLD = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("divisor")
    return run_ranks(divisor_runs, WORLD, args=(str(tmp),), timeout=300), tmp


@pytest.mark.parametrize("name", list(CASES))
def test_native_route_trains_the_bits_of_plain_ddp(runs: Any, name: str) -> None:
    results, _ = runs
    for r in results:
        plain, instr, said = r["native"][name]
        assert instr == plain, (name, r["rank"])
        assert said == [], said


@pytest.mark.parametrize("name", PYTHON_ROUTE)
def test_python_route_with_the_extension_trains_the_bits_of_plain_ddp(runs: Any, name: str) -> None:
    results, _ = runs
    for r in results:
        plain, instr, said = r["python"][name]
        assert instr == plain, (name, r["rank"])
        assert not [s for s in said if "last bits" in s or "not honoured" in s], said


def test_without_the_extension_each_inexact_case_is_said_once(runs: Any) -> None:
    results, _ = runs
    for r in results:
        _, said = r["bare"]["kept"]
        assert len([s for s in said if "gradient_as_bucket_view=True at a world size of 3" in s]) == 1, said
        _, said = r["bare"]["join"]
        assert len([s for s in said if "divide_by_initial_world_size=False" in s]) == 1, said


def test_the_join_run_reads_as_usual(runs: Any) -> None:
    _, tmp = runs
    run = ddpdoctor.load_run(tmp / "join")
    assert {rank: len(log.steps) for rank, log in run.ranks.items()} == {0: 5, 1: 4, 2: 2}
    found = ddpdoctor.analyze(run).findings
    assert not [f for f in found if f.code in ("replica-divergence", "buffer-divergence")], found
