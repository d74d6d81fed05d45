"""Every zoo script, run as a user runs it: the right code, names, ranks, live warning and fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ddpdoctor
from ddpdoctor.analysis import at_least
from ddpdoctor.cli.main import main
from tests.zoo_runs import ZooRuns

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "examples" / "zoo"


def findings(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {f.code: f.to_dict() for f in ddpdoctor.analyze(ddpdoctor.load_run(run_dir)).findings}


# script, extra args, code, severity, names that must be named (None: no names), must the script succeed
CASES = [
    ("frozen_after_wrap", (), "frozen-after-wrap", "error", ["body.0.weight", "body.0.bias"], False),
    ("frozen_after_wrap", ("--find-unused",), "frozen-after-wrap", "warning", ["body.0.weight", "body.0.bias"], True),
    ("unfrozen_after_wrap", (), "unfrozen-after-wrap", "error", ["body.0.weight", "body.0.bias"], True),
    ("replica_divergence", (), "replica-divergence", "error", ["head.weight"], True),
    ("buffer_divergence", (), "buffer-divergence", "warning", ["body.1.running_mean", "body.1.running_var"], True),
    ("constant_buffers", (), "constant-buffers", "warning", ["table"], True),
    ("buffer_broadcast_cost", (), "buffer-broadcast-cost", "warning", None, True),
    ("unused_parameters", (), "unused-parameters", "warning", ["aux_head.weight", "aux_head.bias"], True),
    ("find_unused_unneeded", (), "find-unused-unneeded", "warning", None, True),
    ("sync_during_accumulation", (), "sync-during-accumulation", "warning", None, True),
]


@pytest.mark.parametrize(
    "script, args, code, severity, names, succeeds", CASES, ids=[f"{c[0]}{''.join(c[1])}" for c in CASES]
)
def test_zoo_script_raises_its_finding(
    zoo_runs: ZooRuns,
    script: str,
    args: tuple[str, ...],
    code: str,
    severity: str,
    names: list[str] | None,
    succeeds: bool,
) -> None:
    proc, run_dir = zoo_runs.run(ZOO / f"{script}.py", *args)
    assert (proc.returncode == 0) is succeeds, proc.stderr[-3000:]
    found = findings(run_dir)
    assert code in found, f"{code} not in {sorted(found)}"
    f = found[code]
    assert f["severity"] == severity
    assert f["ranks"] == [0, 1] if code != "replica-divergence" else 1 in f["ranks"]
    assert f["step"] is not None and f["fix"] and f["evidence"]
    if names is not None:
        assert set(names) <= set(f["evidence"]["names"])
    # raised live too: a Python warning of the family's category, with the code, on stderr
    assert (
        f"Warning: ddpdoctor [rank 0] {code}:" in proc.stderr or f"Warning: ddpdoctor [rank 1] {code}:" in proc.stderr
    )
    # ... and written to the log as a finding record by the rank
    run = ddpdoctor.load_run(run_dir)
    assert any(r.code == code for log in run.ranks.values() for r in log.findings)


def test_frozen_after_wrap_is_on_stderr_and_disk_before_ddp_fails(zoo_runs: ZooRuns, tmp_path: Path) -> None:
    # the same run as test_zoo_script_raises_its_finding[frozen_after_wrap]
    proc, run_dir = zoo_runs.run(ZOO / "frozen_after_wrap.py")
    assert proc.returncode != 0
    error_at = proc.stderr.find("Expected to have finished reduction in the prior iteration")
    warned_at = proc.stderr.find("frozen-after-wrap")
    assert 0 <= warned_at < error_at
    assert "StaleRequiresGradWarning" in proc.stderr
    out = tmp_path / "report.json"
    assert main(["report", str(run_dir), "--format", "json", "-o", str(out), "--fail-on", "error"]) == 1
    report = json.loads(out.read_text())
    frozen = next(f for f in report["findings"] if f["code"] == "frozen-after-wrap")
    assert "real cause" in frozen["detail"] and "ddpdoctor.rewrap(model)" in frozen["fix"]
    assert {r["status"] for r in report["ranks"]} == {"failed"}  # DDP's exception ended the with-block
    assert all(r["end_reason"] == "error: RuntimeError" for r in report["ranks"])


def test_unfreeze_after_wrap_is_confirmed_by_the_divergence_check(zoo_runs: ZooRuns) -> None:
    # the same run as test_zoo_script_raises_its_finding[unfrozen_after_wrap]
    _, run_dir = zoo_runs.run(ZOO / "unfrozen_after_wrap.py")
    found = findings(run_dir)
    assert "body.0.weight" in found["replica-divergence"]["evidence"]["names"]


def test_healthy_script_yields_no_warning_or_error(zoo_runs: ZooRuns) -> None:
    proc, run_dir = zoo_runs.run(ZOO / "healthy.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = ddpdoctor.analyze(ddpdoctor.load_run(run_dir))
    assert at_least(report.findings, "warning") == []
    assert "Warning: ddpdoctor" not in proc.stderr


def test_gradual_unfreeze_with_rewrap_keeps_replicas_identical(zoo_runs: ZooRuns) -> None:
    proc, run_dir = zoo_runs.run(ROOT / "examples" / "gradual_unfreeze.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: 8/8 parameter tensors trained, replicas identical: True" in proc.stdout
    run = ddpdoctor.load_run(run_dir)
    log = run.ranks[0]
    assert [h.reason for h in log.headers] == ["attach", "rewrap", "rewrap", "rewrap"]
    assert [h.first_step for h in log.headers] == [0, 4, 8, 12]
    assert [s.step for s in log.steps] == list(range(16))  # one log, numbering goes on
    assert [sum(p.reduced for p in h.params) for h in log.headers] == [2, 4, 6, 8]
    assert at_least(ddpdoctor.analyze(run).findings, "warning") == []


def test_gradual_unfreeze_without_rewrap_is_caught(zoo_runs: ZooRuns) -> None:
    proc, run_dir = zoo_runs.run(ROOT / "examples" / "gradual_unfreeze.py", "--wrong")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replicas identical: False" in proc.stdout
    found = findings(run_dir)
    assert {"unfrozen-after-wrap", "replica-divergence"} <= set(found)
    assert "ReplicaDivergenceWarning" in proc.stderr  # check_replicas warned
