"""The bucket advice is never wrong: it never names the run's own cap as a best to move to, never
tells a run with tiny buckets to make them smaller, and says so where it cannot predict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ddpdoctor
from ddpdoctor.analysis.bucket_sim import Prediction
from ddpdoctor.analysis.bucket_size import MAX_REPLAYED_RANKS, cap_text, job_of, same_cap, savings, what_if
from ddpdoctor.analysis.comm_advice import _bucket_advice
from ddpdoctor.analysis.from_run import rank_backward, what_if_run
from tests.bucket_workers import LINK_MS, latency_bound_runs
from tests.ddp_harness import run_ranks
from tests.zoo_runs import ZooRuns

ZOO = Path(__file__).resolve().parents[1] / "examples" / "zoo"


def _p(**kw: Any) -> dict[str, Any]:
    base = {
        "method": "replay",
        "measured_step_ms": 31.0,
        "confidence": "high",
        "calibration_error_pct": 5.0,
        "current_bucket_cap_mb": 10485 / 2**20,  # what DDP keeps of bucket_cap_mb=0.01
        "current_buckets": 16,
        "bucket_cap_verdict": "no other bucket_cap_mb is predicted to save 1.6 ms or more in three of four steps",
        "best_other_bucket_cap_mb": 25.0,
        "best_other_step_ms": 30.5,
    }
    return {**base, **kw}


def test_caps_read_as_set() -> None:
    assert cap_text(10485 / 2**20) == "0.01" and cap_text(25.0) == "25" and cap_text(0.5) == "0.5"
    assert same_cap(10485 / 2**20, 0.01) and not same_cap(0.01, 0.1)


def test_without_a_recommendation_the_advice_says_why_and_names_no_cap() -> None:
    text, fix = _bucket_advice(_p())
    assert text == (
        "nothing about bucket_cap_mb: no other bucket_cap_mb is predicted to save 1.6 ms or more in three of four steps"
    )
    assert fix == "" and "0.00999" not in text and "predicted best" not in text


def test_a_larger_cap_is_recommended_with_its_saving_and_why() -> None:
    p = _p(recommended_bucket_cap_mb=25.0, bucket_cap_step_ms=8.0)
    text, fix = _bucket_advice(p)
    assert text == (
        "with bucket_cap_mb=25 about 8.0 ms (23.0 ms saved: fewer all-reduces, each with its fixed cost; high "
        "confidence, the replay reproduces this run's step within 5%)"
    )
    assert fix == "Fewer all-reduces, each with its fixed cost: DistributedDataParallel(net, bucket_cap_mb=25)."


def test_a_replay_that_cannot_predict_the_run_says_so() -> None:
    verdict = "the replay cannot predict this run: it misses the measured step by 65%"
    text, fix = _bucket_advice(_p(confidence="low", calibration_error_pct=65.0, bucket_cap_verdict=verdict))
    assert text == f"nothing about bucket_cap_mb: {verdict}" and fix == ""


def test_savings_are_judged_step_by_step() -> None:
    # the median saving, and the lower quartile: what the cap saves in three of four replayed steps
    current = Prediction(cap_mb=0.01, buckets=8, step_ms=30.0, per_sample_ms=(30.0, 31.0, 29.0, 30.0, 60.0))
    other = Prediction(cap_mb=1.0, buckets=1, step_ms=20.0, per_sample_ms=(20.0, 20.0, 28.0, 21.0, 30.0))
    median_gain, low = savings(current, other)
    assert median_gain == 10.0 and low == 5.0


def test_tiny_buckets_on_a_real_run(zoo_runs: ZooRuns) -> None:
    proc, run_dir = zoo_runs.run(ZOO / "tiny_buckets.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = ddpdoctor.analyze(ddpdoctor.load_run(run_dir))
    text = "\n".join(f"{f.title}\n{f.detail}\n{f.fix}" for f in report.findings)
    assert "0.00999" not in text
    assert "a smaller bucket_cap_mb" not in text  # the cap is already tiny
    for f in report.findings:
        if f.code == "bucket-size":  # a recommendation is a larger cap
            assert f.evidence["recommended_bucket_cap_mb"] > 0.01
        p = f.evidence.get("predicted", {})
        if p.get("recommended_bucket_cap_mb") is not None:
            assert p["recommended_bucket_cap_mb"] > 0.01 and p["confidence"] != "low"
        assert "predicted best" not in f.detail


@pytest.fixture(scope="module")
def latency_bound(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("latency-bound")
    run_ranks(latency_bound_runs, 2, args=(str(tmp),))
    return tmp


def _said(report: ddpdoctor.Report) -> str:
    return "\n".join(f"{f.title}\n{f.detail}\n{f.fix}" for f in report.findings)


def test_a_latency_bound_run_gets_a_larger_cap_with_its_saving(latency_bound: Path) -> None:
    run = ddpdoctor.load_run(latency_bound / "small")
    w = what_if_run(run)
    assert w is not None
    # the replay of the run's own layout (every rank's backward, the fitted all-reduce cost)
    # reproduces its measured step, and the two bucket sizes tell the fixed cost apart
    assert w.current.buckets == len(run.ranks[0].layouts[-1].buckets) == 8
    assert w.calibration_error_pct <= 30 and w.model.split_known
    assert w.model.latency_us >= 0.5 * LINK_MS * 1000  # the planted latency, seen per all-reduce
    rec = w.recommended
    assert rec is not None and rec.cap_mb > w.current.cap_mb and rec.buckets < w.current.buckets
    assert w.low_gain_ms >= 0.05 * w.current.step_ms and w.gain_ms >= w.low_gain_ms
    report = ddpdoctor.analyze(run)
    [finding] = [f for f in report.findings if f.code == "bucket-size"]
    ev = finding.evidence
    assert ev["recommended_bucket_cap_mb"] == rec.cap_mb and ev["predicted_gain_ms"] > 0
    assert ev["predicted_step_ms"] < ev["measured_step_ms"]
    assert f"bucket_cap_mb={cap_text(rec.cap_mb)} is predicted to make the step" in finding.title
    assert "ms saved, at least" in finding.detail and "three of four replayed steps" in finding.detail
    assert "0.00999" not in _said(report)
    # exposed-communication's advice names the same cap (where the host's load leaves it a warning)
    exposed = [f for f in report.findings if f.code == "exposed-communication" and f.severity == "warning"]
    for f in exposed:
        assert f.evidence["predicted"]["recommended_bucket_cap_mb"] == rec.cap_mb
        assert f"DistributedDataParallel(net, bucket_cap_mb={cap_text(rec.cap_mb)})" in f.fix


def test_a_run_at_a_good_cap_gets_no_bucket_advice(latency_bound: Path) -> None:
    run = ddpdoctor.load_run(latency_bound / "good")
    w = what_if_run(run)
    assert w is not None and w.current.buckets == 1 and not w.model.split_known
    # it says why it names no cap: no saving predicted, or (a loaded host's short steps) a replay
    # that misses the run, never the current cap as a best to move to
    assert w.recommended is None and w.verdict and "bucket_cap_mb=25" not in w.verdict
    report = ddpdoctor.analyze(run)
    assert not [f for f in report.findings if f.code == "bucket-size"]
    for f in report.findings:
        assert "bucket_cap_mb=" not in f.fix, f.code  # no cap to move to, the current one included
        p = f.evidence.get("predicted", {})
        if p.get("method") == "replay":
            assert "recommended_bucket_cap_mb" not in p and f"nothing about bucket_cap_mb: {w.verdict}" in f.detail


def test_a_large_job_replays_its_latest_ranks_only(latency_bound: Path) -> None:
    run = ddpdoctor.load_run(latency_bound / "small")
    # 20 ranks, each a copy of one of the two real ones
    ranks = {r: rank_backward(run.ranks[r % 2]) for r in range(20)}
    job = job_of(ranks)
    assert job is not None
    _, jobs = job
    assert all(len(j.passes) == MAX_REPLAYED_RANKS for j in jobs)
    w = what_if(ranks)
    assert w is not None and w.current.buckets == 8
