"""The second round of zoo scenarios, run as a user runs them (plain scripts on real gloo ranks)
and judged from ``ddpdoctor report --format json``: stragglers named by the time they cost,
advice measured from the run, short-run divergence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ddpdoctor
from ddpdoctor.cli.main import main
from tests.zoo_runs import ZooRuns

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "examples" / "zoo"


def report(script: str, tmp_path: Path, zoo_runs: ZooRuns | None) -> dict[str, Any]:
    """Run examples/zoo/<script>.py on 2 gloo ranks, then ``ddpdoctor report --format json``.

    With ``zoo_runs``, the pytest run's one run of that script (test_zoo.py reads the same ones);
    without, a run of its own (a scenario that changes the machine around the script)."""
    if zoo_runs is not None:
        proc, run_dir = zoo_runs.run(ZOO / f"{script}.py")
    else:
        run_dir = tmp_path / "run"
        proc = subprocess.run(
            [sys.executable, str(ZOO / f"{script}.py"), str(run_dir)],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "report.json"
    assert main(["report", str(run_dir), "--format", "json", "-o", str(out)]) == 0
    return json.loads(out.read_text())


def by_code(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["code"]: f for f in rep["findings"]}


def test_rank_0_busy_between_steps_every_8th_step(tmp_path: Path, zoo_runs: ZooRuns) -> None:
    f = by_code(report("straggler_between_steps", tmp_path, zoo_runs))["straggler"]
    ev = f["evidence"]
    assert f["ranks"] == [0] and f["severity"] == "warning"
    assert ev["pattern"] == "periodic" and ev["every_n_steps"] == 8
    # the four planted steps; a loaded machine may add a jitter step or two above the noise floor
    assert {8, 16, 24, 32} <= set(ev["late_steps"]) and 4 <= ev["latest_in_steps"] <= 8
    assert ev["phase"] == "between steps" and ev["phase_excess_ms"]["between steps"] >= 500
    assert ev["time_lost_ms"] >= 4 * 550 and ev["first_step"] == 8
    assert "async_save" in f["fix"]


def test_rank_1_slow_backward_on_every_third_step(tmp_path: Path, zoo_runs: ZooRuns) -> None:
    f = by_code(report("straggler_intermittent", tmp_path, zoo_runs))["straggler"]
    ev = f["evidence"]
    assert f["ranks"] == [1] and ev["phase"] == "backward"
    # latest in a third of the 29 steps after step 0 (start-up skew, left out) ...
    assert 8 <= ev["latest_in_steps"] <= 12 and ev["steps"] == 29
    assert ev["time_lost_ms"] >= 8 * 110  # ... and named for what it cost
    assert ev["pattern"] in ("periodic", "intermittent") and ev.get("every_n_steps") in (3, None)


def test_communication_bound_predicted_savings(tmp_path: Path, zoo_runs: ZooRuns) -> None:
    f = by_code(report("communication_bound", tmp_path, zoo_runs))["exposed-communication"]
    assert f["severity"] == "warning"
    p = f["evidence"]["predicted"]
    assert p["compress_hook_step_ms"] < p["measured_step_ms"]  # half the bytes: a shorter step
    # a cap with its predicted step, or why the what-if names none (said in the detail either way)
    assert ("recommended_bucket_cap_mb" in p and "bucket_cap_step_ms" in p) or p["bucket_cap_verdict"]
    assert "bf16_compress_hook" in f["fix"] and "bucket_cap_mb" in f["detail"]


def test_communication_bound_under_load_no_straggler(tmp_path: Path) -> None:
    # other work loads both cores while the job runs: jitter on every rank, blamed on none. The
    # load also stretches compute more than the all-reduce, so the exposed share may fall under the
    # warning line here (about 0.4 of the step on a quiet machine): the finding's severity and
    # advice are the quiet test's to check
    load = [subprocess.Popen([sys.executable, "-c", "import os\nos.nice(5)\nwhile True: pass"]) for _ in range(2)]
    # one busy loop per core: both loops on the core of one rank would make that rank really late
    # at every step (a straggler the report rightly names: CI once saw rank 0, 27 ms late in 11 steps).
    # Each loop a little below the job's priority: the cores stay busy and every step jitters, but
    # the scheduler does not keep one rank off its core for tens of ms while the other runs (which
    # is a straggler too: CI once saw rank 0 late 233 ms in 3 steps with loops at the job's priority)
    cpus = sorted(os.sched_getaffinity(0))
    for i, p in enumerate(load):
        os.sched_setaffinity(p.pid, {cpus[i % len(cpus)]})
    try:
        rep = report("communication_bound", tmp_path, None)  # its own run: under load
    finally:
        for p in load:
            p.kill()
            p.wait(timeout=10)
    found = by_code(rep)
    assert "straggler" not in found, found.get("straggler")
    assert "exposed-communication" in found, sorted(found)


def test_find_unused_with_a_static_unused_set_suggests_static_graph(tmp_path: Path, zoo_runs: ZooRuns) -> None:
    f = by_code(report("unused_parameters", tmp_path, zoo_runs))["find-unused-unneeded"]
    assert f["evidence"]["static_set"] is True and f["evidence"]["names"] == ["aux_head.weight", "aux_head.bias"]
    assert f["evidence"]["post_forward_ms"] > 0 and "static_graph=True" in f["fix"]


def test_replicas_drifting_after_step_5_of_30_are_named_with_the_first_step(tmp_path: Path, zoo_runs: ZooRuns) -> None:
    f = by_code(report("replica_divergence_short_run", tmp_path, zoo_runs))["replica-divergence"]
    ev = f["evidence"]
    assert "body.3.weight" in ev["names"] and 5 < ev["first_step"] <= 30
    assert ev["last_equal_step"] is not None and ev["last_equal_step"] <= 5
    assert f"from step {ev['first_step']}" in f["title"]


def test_redundant_buffer_broadcast_is_said_with_its_cost(tmp_path: Path, zoo_runs: ZooRuns) -> None:
    found = by_code(report("redundant_buffer_broadcast", tmp_path, zoo_runs))
    f = found["buffer-broadcast-cost"]
    # the constant projection is no buffer that changes, though its float32 fingerprint sum is not
    # the header's float64 checksum; it is named constant instead
    assert f["evidence"]["broadcast_redundant"] is True and f["evidence"]["changing_buffers"] == ["mask"]
    assert found["constant-buffers"]["evidence"]["names"] == ["projection"]
    assert f["evidence"]["predicted_saving_ms"] > 0 and "broadcast_buffers=False" in f["fix"]


def test_buffers_that_would_drift_make_turning_the_broadcast_off_unsafe(tmp_path: Path, zoo_runs: ZooRuns) -> None:
    f = by_code(report("buffer_broadcast_cost", tmp_path, zoo_runs))["buffer-broadcast-cost"]
    assert f["evidence"]["broadcast_redundant"] is False and f["evidence"]["would_drift"] == ["feature_ema"]
    assert "unsafe" in f["detail"]


def test_slow_data_loader_is_not_blamed_on_the_buffer_broadcast(tmp_path: Path, zoo_runs: ZooRuns) -> None:
    # rank 0 waits for rank 1's data inside DDP's buffer broadcast (the step's first collective):
    # the straggler is named, and neither the report nor rank 0's live check blames the broadcast
    # (its own all-reduces bound what a transfer of a few hundred bytes can cost)
    found = by_code(report("straggler_data_loading", tmp_path, zoo_runs))
    f = found["straggler"]
    assert f["ranks"] == [1] and f["evidence"]["phase"] == "data loading (before forward)"
    # the broadcast's own cost (1.5-3 ms a step here, measured by turning it off) may reach the 3%
    # line on a slow machine; if the report names it, its figure is that cost, not rank 0's wait
    cost = found.get("buffer-broadcast-cost")
    assert cost is None or (cost["severity"] == "info" and cost["evidence"]["broadcast_ms"] < 15.0), cost
    proc, run_dir = zoo_runs.run(ZOO / "straggler_data_loading.py")
    assert "buffer-broadcast-cost" not in proc.stderr
    run = ddpdoctor.load_run(run_dir)
    assert not [r for log in run.ranks.values() for r in log.findings if r.code == "buffer-broadcast-cost"]
    # rank 0 did spend the wait inside the broadcast: without the bound its floor is most of the step
    waits = sorted(s.bcast_us for s in run.ranks[0].steps if s.bcast_us is not None)
    assert len(waits) >= 25 and waits[len(waits) // 10] >= 10_000
