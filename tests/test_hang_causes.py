"""Hangs with their cause, on real 2-rank gloo jobs of the zoo: a rank validating alone through
the DDP wrapper (grad off: hung at the end; grad on: hung in training), uneven inputs without
Join, a rank stuck in its own code, a killed rank. Each is named, with every rank's stack, by the
report and the live view while the job is still hung; the test kills the job after. Healthy
look-alikes (validation through ``model.module``, or through the wrapper on every rank; uneven
inputs under Join) stay silent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import ddpdoctor
from ddpdoctor.analysis.live_run import LiveRun, LiveSnapshot
from ddpdoctor.runlog import DirSource
from tests.ddp_harness import free_port
from tests.zoo_runs import ZooRuns

#: zoo scripts that hang, run as a user runs them
pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "examples" / "zoo"
HANG_TIMEOUT = "2"


def _hang(run_dir: Path) -> ddpdoctor.Finding | None:
    """The error-level hang finding once every rank's watchdog fired (each rank's stack known)."""
    if not run_dir.exists():
        return None
    report = ddpdoctor.analyze(ddpdoctor.load_run(run_dir))
    found = next((f for f in report.findings if f.code == "hang" and f.severity == "error"), None)
    if found is None or not all("stack" in m for m in found.evidence["missing"].values()):
        return None
    return found


def _while_hung(
    script: str, run_dir: Path, *args: str, ready: Callable[[Path], ddpdoctor.Finding | None] = _hang
) -> tuple[ddpdoctor.Finding, ddpdoctor.Report, LiveSnapshot]:
    """Run a zoo script in its own session with a short hang timeout until ``ready`` finds its
    finding; the report and the live view read while it is still hung; then kill the whole job."""
    proc = subprocess.Popen(
        [sys.executable, str(ZOO / f"{script}.py"), str(run_dir), *args],
        cwd=ROOT,
        env=dict(os.environ, DDPDOCTOR_HANG_TIMEOUT=HANG_TIMEOUT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        found = ready(run_dir)
        while found is None:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else "exited"
            assert time.monotonic() < deadline, "no hang finding within 180 s"
            time.sleep(0.3)
            found = ready(run_dir)
        report = ddpdoctor.analyze(ddpdoctor.load_run(run_dir))
        source = DirSource(run_dir)
        live = LiveRun(label=source.label)
        live.feed(source.poll())
        snap = live.snapshot()
        assert proc.poll() is None, "the job must still be hung"
        return found, report, snap
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


def _codes(report: ddpdoctor.Report) -> set[str]:
    return {f.code for f in report.findings}


def test_lone_validation_without_grad_hangs_at_the_end_named_with_its_cause(tmp_path: Path) -> None:
    hang, report, live = _while_hung("lone_validation", tmp_path / "run")
    # rank 0 waits in the broadcast of its lone forward; rank 1, in the final barrier, is missing
    assert hang.evidence["waiting"][0]["phase"] == "buffer broadcast"
    assert hang.evidence["waiting"][0]["collective"] == "broadcast_coalesced"
    assert "a forward outside the training steps" in hang.title and "missing: rank 1" in hang.title
    missing = hang.evidence["missing"][1]
    assert missing["collective"] == "barrier" and missing["cause"] == "other-collective"
    assert any("dist.barrier()" in line for line in missing["stack"])
    assert any("validate(model, gen)" in line for line in hang.evidence["waiting"][0]["stack"])
    assert "rank 0's stack (waiting)" in hang.detail and "cause: buffer broadcast missing on rank 0" in hang.detail
    assert "model.module(x)" in hang.fix
    # what the waiting broadcast carries: the BatchNorm's buffers
    bn = ["body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"]
    assert hang.evidence["broadcast_buffers"] == bn
    assert "the broadcast carries rank 0's module buffers (body.1.running_mean, " in hang.detail
    # the cause, named from the first step it shows (before any hang)
    [mismatch] = [f for f in report.findings if f.code == "mismatched-collectives"]
    assert mismatch.ranks == [0] and mismatch.step == 5
    assert mismatch.evidence["collective"] == "buffer broadcast"
    assert mismatch.evidence["without"][0][:3] == [5, 10, 15]
    assert "model.module(x)" in mismatch.fix
    # the live view says the same
    live_codes = {f.code: f for f in live.findings}
    assert live_codes["mismatched-collectives"].step == 5
    assert live_codes["hang"].severity == "error" and "missing: rank 1" in live_codes["hang"].title
    assert {r.rank: r.status for r in live.ranks} == {0: "hung", 1: "hung"}


def test_lone_validation_with_grad_hangs_in_training_named_as_a_step_without_all_reduce(tmp_path: Path) -> None:
    hang, _, live = _while_hung("lone_validation", tmp_path / "run", "--grad")
    assert hang.ranks == [0]
    assert hang.evidence["missing"][0]["steps_without_allreduce"] == [5]
    assert "model.module" in hang.fix
    # the bucket that waits, by its parameters
    assert "bucket 0 holds body.0.weight" in hang.detail
    assert any(f.code == "hang" and f.ranks == [0] for f in live.findings)


def test_uneven_inputs_without_join_name_the_rank_that_left_its_loop(tmp_path: Path) -> None:
    hang, _, live = _while_hung("uneven_inputs", tmp_path / "run")
    assert hang.ranks == [1] and hang.title.endswith("missing: rank 1 (left its training loop)")
    assert hang.evidence["missing"][1]["cause"] == "left-loop"
    assert any("dist.barrier()" in line for line in hang.evidence["missing"][1]["stack"])
    assert "Join" in hang.fix and "drop_last=True" in hang.fix
    live_hang = next(f for f in live.findings if f.code == "hang" and f.severity == "error")
    assert live_hang.fix == hang.fix


def test_a_rank_stuck_in_its_own_code_is_named_with_its_stack(tmp_path: Path) -> None:
    hang, _, _ = _while_hung("stuck_in_compute", tmp_path / "run")
    assert hang.ranks == [1] and "(busy in its own code)" in hang.title
    missing = hang.evidence["missing"][1]
    assert missing["cause"] == "stuck-in-compute" and missing["phase"] == "forward"
    assert any("stuck_in_compute.py" in line and "time.sleep" in line for line in missing["stack"])
    assert hang.evidence["waiting"][0]["phase"] == "allreduce"
    assert "bucket 0 holds " in hang.detail and "py-spy" in hang.fix


def test_a_killed_rank_is_named_lost_and_the_survivor_failed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(ZOO / "dead_rank.py"), str(run_dir)],
            cwd=ROOT,
            env=dict(os.environ, RANK=str(r), MASTER_PORT=port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    try:
        codes = [p.wait(180) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0
    report = ddpdoctor.analyze(ddpdoctor.load_run(run_dir))
    [lost] = [f for f in report.findings if f.code == "rank-lost"]
    assert lost.ranks == [1] and "None" not in lost.title
    assert "rank 0 then failed in its next collective" in lost.detail
    assert "hang" not in _codes(report)


@pytest.mark.parametrize(
    "script, args",
    [("validation_healthy", ()), ("validation_healthy", ("--every-rank",)), ("uneven_inputs", ("--join",))],
    ids=["rank0-through-module", "every-rank-through-wrapper", "uneven-under-join"],
)
def test_healthy_look_alikes_stay_silent(zoo_runs: ZooRuns, script: str, args: tuple[str, ...]) -> None:
    proc, run_dir = zoo_runs.run(ZOO / f"{script}.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = ddpdoctor.analyze(ddpdoctor.load_run(run_dir))
    assert not {"hang", "mismatched-collectives", "rank-lost"} & _codes(report)
    source = DirSource(run_dir)
    live = LiveRun(label=source.label)
    live.feed(source.poll())
    assert not {"hang", "mismatched-collectives", "rank-lost"} & {f.code for f in live.snapshot().findings}


def test_the_collective_is_read_off_the_stack() -> None:
    from ddpdoctor.runtime.process.watchdog import collective_in_stack

    site = "/usr/lib/python3.11/site-packages/torch"
    barrier = [
        "/job/train.py:52 in train: dist.barrier()",
        f"{site}/distributed/c10d_logger.py:83 in wrapper: return func(*args, **kwargs)",
        f"{site}/distributed/distributed_c10d.py:5356 in barrier: work.wait()",
    ]
    assert collective_in_stack(barrier) == "barrier"
    gather = [
        "/job/train.py:9 in main: dist.all_gather_object(out, obj)",
        f"{site}/distributed/distributed_c10d.py:3100 in all_gather_object: all_gather(sizes, size)",
        f"{site}/distributed/distributed_c10d.py:4000 in all_gather: work.wait()",
        f"{site}/distributed/distributed_c10d.py:4100 in _private: x",
    ]
    assert collective_in_stack(gather) == "all_gather_object"  # the call the script made
    broadcast = [
        "/job/train.py:34 in validate: out = model(x)",
        f"{site}/nn/parallel/distributed.py:2425 in _sync_buffers: self._sync_module_buffers(authoritative_rank)",
        f"{site}/nn/parallel/distributed.py:2363 in _distributed_broadcast_coalesced: dist._broadcast_coalesced(",
    ]
    assert collective_in_stack(broadcast) == "broadcast_coalesced"
    assert collective_in_stack(["/job/train.py:29 in forward: time.sleep(0.05)"]) == ""


def test_collectives_compared_only_at_steps_every_rank_logged() -> None:
    from ddpdoctor.analysis.collectives import StepCollectives, uneven_collectives

    both = StepCollectives(broadcast=True, allreduce=True)
    lone = StepCollectives(broadcast=False, allreduce=True)
    same = {0: {s: both for s in range(10)}, 1: {s: both for s in range(8)}}  # rank 1 not there yet
    assert uneven_collectives(same) == []
    odd = {0: {**same[0], 5: lone}, 1: same[1]}
    [f] = uneven_collectives(odd)
    assert f.ranks == [0] and f.step == 5 and f.evidence["without"] == {0: [5]}
    assert f.title.startswith("rank 0's buffer broadcasts are one off from the other ranks' from step 5")
    bare = {0: {**same[0], 3: StepCollectives(broadcast=True, allreduce=False)}, 1: same[1]}
    [g] = uneven_collectives(bare)
    assert g.evidence["collective"] == "gradient all-reduce" and g.ranks == [0] and "zero loss" in g.fix
