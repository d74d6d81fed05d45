"""Straggler attribution from bucket arrival skew, on real 2-rank gloo runs with planted delays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ddpdoctor
from tests.ddp_harness import run_ranks
from tests.runtime_workers import straggler_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("straggler")
    run_ranks(straggler_runs, 2, args=(str(tmp),), timeout=240)
    return tmp


def _findings(path: Path) -> dict[str, Any]:
    return {f.code: f for f in ddpdoctor.analyze(ddpdoctor.load_run(path)).findings}


def test_a_rank_slow_in_backward_is_named_with_its_phase(runs: Path) -> None:
    run = ddpdoctor.load_run(runs / "slow-backward")
    report = ddpdoctor.analyze(run)
    # per-rank step totals are evened out by the all-reduce: they cannot tell who is slow ...
    fast, slow = (r["medians_ms"]["step"] for r in report.ranks)
    assert abs(fast - slow) < 20
    # ... the arrival skew can
    f = {f.code: f for f in report.findings}["straggler"]
    assert f.ranks == [1] and f.evidence["phase"] == "backward"
    assert f.evidence["median_lateness_ms"] >= 100
    assert f.evidence["phase_excess_ms"]["backward"] >= 140
    assert f.evidence["others_waited_ms"] >= 100 * 5
    assert "backward" in f.title


def test_a_rank_slow_in_data_loading_is_named_with_its_phase(runs: Path) -> None:
    f = _findings(runs / "slow-data")["straggler"]
    assert f.ranks == [1] and f.evidence["phase"] == "data loading (before forward)"
    assert f.evidence["phase_excess_ms"]["data loading (before forward)"] >= 80
    assert "DataLoader" in f.fix


def test_a_healthy_run_has_no_straggler(runs: Path) -> None:
    assert "straggler" not in _findings(runs / "healthy")
