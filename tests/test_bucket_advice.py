"""The bucket advice is never wrong: it never names the run's own cap as a best to move to, never
tells a run with tiny buckets to make them smaller, and says so where it cannot predict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ddpdoctor
from ddpdoctor.analysis.bucket_size import cap_text, same_cap
from ddpdoctor.analysis.comm_advice import _bucket_advice
from tests.zoo_runs import ZooRuns

ZOO = Path(__file__).resolve().parents[1] / "examples" / "zoo"


def _p(**kw: Any) -> dict[str, Any]:
    base = {
        "confidence": "high",
        "calibration_error_pct": 5.0,
        "current_bucket_cap_mb": 10485 / 2**20,  # what DDP keeps of bucket_cap_mb=0.01
        "current_buckets": 16,
        "recommended_bucket_cap_mb": 10485 / 2**20,
        "best_is_current": True,
        "bucket_cap_step_ms": 30.0,
        "best_other_bucket_cap_mb": 25.0,
        "best_other_step_ms": 30.5,
    }
    return {**base, **kw}


def test_caps_read_as_set() -> None:
    assert cap_text(10485 / 2**20) == "0.01" and cap_text(25.0) == "25" and cap_text(0.5) == "0.5"
    assert same_cap(10485 / 2**20, 0.01) and not same_cap(0.01, 0.1)


def test_the_current_cap_is_never_named_a_best_to_move_to() -> None:
    text, fix = _bucket_advice(_p(), 30.0)
    assert text == "no other bucket_cap_mb is predicted to help: the current 0.01 MiB is predicted best"
    assert fix == "" and "0.00999" not in text


def test_a_larger_cap_is_recommended_with_its_saving_and_why() -> None:
    p = _p(best_is_current=False, recommended_bucket_cap_mb=25.0, bucket_cap_step_ms=8.0)
    text, fix = _bucket_advice(p, 31.0)
    assert text == "with bucket_cap_mb=25 about 8.0 ms (23.0 ms saved: fewer all-reduces, each with its fixed cost)"
    assert fix == "Fewer all-reduces, each with its fixed cost: DistributedDataParallel(net, bucket_cap_mb=25)."


def test_a_replay_that_cannot_predict_the_run_says_so() -> None:
    # no gain predicted, by a replay that misses the run: it says it cannot tell, not "nothing helps"
    text, fix = _bucket_advice(_p(confidence="low", calibration_error_pct=65.0), 30.0)
    assert text == (
        "the bucket replay cannot predict this run (before calibration it missed the measured step by 65%), "
        "so it says nothing of bucket_cap_mb"
    )
    assert fix == ""
    # a large predicted gain is still worth trying, said with its confidence
    p = _p(confidence="low", calibration_error_pct=81.0, best_is_current=False, recommended_bucket_cap_mb=1.0)
    text, fix = _bucket_advice({**p, "bucket_cap_step_ms": 13.5}, 33.4)
    assert text.startswith("with bucket_cap_mb=1 about 13.5 ms (19.9 ms saved: fewer all-reduces")
    assert text.endswith(
        "low confidence: before calibration the replay missed this run's step by 81%, try it and compare)"
    )
    assert "bucket_cap_mb=1" in fix


def test_no_worthwhile_gain_names_the_best_other_cap() -> None:
    text, fix = _bucket_advice(_p(best_is_current=False, recommended_bucket_cap_mb=25.0), 30.2)
    assert text.startswith("no bucket_cap_mb is predicted to save 2% or more (the best other, 25 MiB") and not fix


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
        if p.get("method") == "replay" and not p["best_is_current"] and p["confidence"] != "low":
            assert p["recommended_bucket_cap_mb"] > 0.01
        if p:
            assert "predicted best" not in f.detail or p["best_is_current"]
