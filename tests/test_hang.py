"""A rank that skips one step's backward hangs the job: the watchdog and the report name it, while
the job is still hung."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ddpdoctor
from ddpdoctor.analysis.live_run import LiveRun
from ddpdoctor.events import FindingRecord, Hang, decode
from ddpdoctor.events.line_index import is_index_line
from ddpdoctor.runlog import DirSource
from tests.ddp_harness import free_port

SCRIPT = Path(__file__).parent / "scripts" / "skip_a_backward.py"
HANG_TIMEOUT = 2.0


def _records(path: Path) -> list[object]:
    return [decode(line) for line in path.read_bytes().splitlines() if line.strip() and not is_index_line(line)]


def _hang_finding(run_dir: Path) -> ddpdoctor.Finding | None:
    """The hang finding once it can say where the missing rank is (its watchdog fired too)."""
    report = ddpdoctor.analyze(ddpdoctor.load_run(run_dir))
    found = next((f for f in report.findings if f.code == "hang" and f.severity == "error"), None)
    return found if found is not None and "stack" in found.evidence["missing"].get(1, {}) else None


def _start_ranks(script: Path, run_dir: Path) -> list[subprocess.Popen[bytes]]:
    """The two ranks of a hang script (``scripts/hang_job.py``), on a free port; the caller kills them."""
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, str(script), str(run_dir), str(HANG_TIMEOUT)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_PORT=str(port)),
        )
        for r in range(2)
    ]


def test_a_skipped_backward_is_named_while_the_job_hangs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    procs = _start_ranks(SCRIPT, run_dir)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "rank-1-skipped").exists():
            assert time.monotonic() < deadline, "rank 1 never reached the step it skips"
            assert all(p.poll() is None for p in procs), "a rank exited before the hang"
            time.sleep(0.05)
        hung_at = time.monotonic()
        finding = None
        while finding is None and time.monotonic() < hung_at + HANG_TIMEOUT + 5:
            finding = _hang_finding(run_dir)
            if finding is None:
                time.sleep(0.2)
        found_after = time.monotonic() - hung_at
        assert finding is not None, "no hang finding within hang_timeout + 5 s"
        assert all(p.poll() is None for p in procs), "the job must still be hung"

        # the report, as a user runs it, while the job is still hung
        cli = subprocess.run(
            [sys.executable, "-m", "ddpdoctor", "report", str(run_dir), "--format", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        # the live view (`ddpdoctor watch`) over the same files, still hung
        source = DirSource(run_dir)
        live = LiveRun(label=source.label)
        live.feed(source.poll())
        live_snap = live.snapshot()
        assert all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)

    assert found_after <= HANG_TIMEOUT + 5
    assert finding.ranks == [1]
    waiting = finding.evidence["waiting"]
    assert list(waiting) == [0] and waiting[0]["phase"] == "allreduce" and waiting[0]["step"] == 2
    # rank 1 went on to step 3: its forward waits in the BatchNorm buffer broadcast
    missing = finding.evidence["missing"][1]
    assert missing["phase"] == "buffer broadcast" and missing["step"] == 3
    assert any("skip_a_backward.py" in line and "ddp(x)" in line for line in missing["stack"])
    assert missing["steps_without_allreduce"] == [2]  # the skipped backward, named
    assert "missing: rank 1" in finding.title

    # the live finding names the skipped backward as the report does, with the same fix
    live_hang = next(f for f in live_snap.findings if f.code == "hang" and f.severity == "error")
    assert live_hang.ranks == [1] and "missing: rank 1" in live_hang.title
    assert "step 2 without any gradient all-reduce" in live_hang.detail
    assert live_hang.evidence["missing"][1]["steps_without_allreduce"] == [2]
    assert live_hang.fix == finding.fix and "skipped a backward" in live_hang.fix
    assert {r.rank: r.status for r in live_snap.ranks} == {0: "hung", 1: "hung"}

    report = json.loads(cli.stdout)
    hang = next(f for f in report["findings"] if f["code"] == "hang")
    assert hang["severity"] == "error" and hang["ranks"] == [1]
    assert {r["rank"]: r["status"] for r in report["ranks"]} == {0: "hung", 1: "hung"}

    # on disk, flushed at once by each rank's watchdog: where it is, and rank 0's own warning
    rank0 = _records(run_dir / "rank-00000.jsonl")
    stalls = [r for r in rank0 if isinstance(r, Hang)]
    assert stalls and stalls[0].state == "stalled" and stalls[0].pending_bucket is not None
    assert stalls[0].waited_s >= HANG_TIMEOUT
    assert any("loss.backward()" in line for line in stalls[0].stack)
    logged = [r for r in rank0 if isinstance(r, FindingRecord) and r.code == "hang"]
    assert logged and logged[0].severity == "error"
    assert b"HangWarning" in procs[0].stderr.read()


def _hang(rank: int, phase: str, step: int, state: str = "stalled", **kw: Any) -> Hang:
    return Hang(rank=rank, t_mono_ns=0, t_wall_ns=0, state=state, step=step, phase=phase, waited_s=30.0, **kw)


def test_missing_rank_between_steps_or_gone_is_named_with_its_stack() -> None:
    from ddpdoctor.analysis.hang import hang_findings

    latest = {
        0: _hang(0, "allreduce", 7, pending_bucket=1),
        1: _hang(1, "allreduce", 7, pending_bucket=1),
        2: _hang(2, "between steps", 7, stack=["/data/train.py:40 in main: batch = next(it)"]),
    }
    [f] = hang_findings(latest, {0: 6, 1: 6, 2: 7, 3: 5}, 4, ended={3: "close"})
    assert f.severity == "error" and f.ranks == [2, 3]
    assert f.title == (
        "ranks 0, 1 wait in the all-reduce of bucket 1 of step 7; missing: ranks 2, 3 "
        "(busy in its own code, left its training loop)"
    )
    assert f.evidence["missing"][2]["cause"] == "stuck-in-compute" and f.evidence["missing"][3]["cause"] == "left-loop"
    assert "batch = next(it)" in f.detail and "rank 3 has left training" in f.detail
    assert "Join" in f.fix  # no skipped step known: the uneven-data advice
    assert f.evidence["missing"][3]["ended"] == "close"


def test_a_stall_that_resumed_is_info_and_idle_ranks_are_no_hang() -> None:
    from ddpdoctor.analysis.hang import hang_findings

    resumed = hang_findings({0: _hang(0, "between steps", 3, state="resumed")}, {0: 3}, 1)
    assert [(f.code, f.severity) for f in resumed] == [("hang", "info")]
    idle = {r: _hang(r, "between steps", 9) for r in range(2)}  # evaluation on every rank: nobody waits
    assert hang_findings(idle, {0: 9, 1: 9}, 2) == []


def test_a_hang_in_one_ddp_group_names_only_that_groups_missing_rank() -> None:
    from ddpdoctor.analysis.hang import hang_findings_in_groups

    # 4 ranks in two DDP groups (0,1 / 2,3). Group 2,3 hangs: rank 2 waits in its all-reduce at
    # step 7, rank 3 skipped a backward at step 5 and now waits one bucket later. Ranks 0 and 1,
    # of the other group, are stuck in their own work (a model-parallel exchange with 2 and 3):
    # never "missing" from the other group's all-reduce, nor compared with its ranks
    latest = {
        0: _hang(0, "forward", 8),
        1: _hang(1, "forward", 8),
        2: _hang(2, "allreduce", 7, pending_bucket=0, buckets_ready=2),
        3: _hang(3, "allreduce", 8, pending_bucket=0, buckets_ready=2),
    }
    last = {0: 7, 1: 7, 2: 6, 3: 7}
    bare = {3: [5]}
    [f] = hang_findings_in_groups(latest, last, 4, [[0, 1], [2, 3]], bare_steps=bare)
    assert f.severity == "error" and f.ranks == [3]
    assert (
        f.title == "rank 2 waits in the all-reduce of bucket 0 of step 7; missing: rank 3 (a step without all-reduce)"
    )
    assert f.evidence["missing"][3]["steps_without_allreduce"] == [5] and "skipped a backward" in f.fix
    # the same records read as one group (what was said before): ranks 0 and 1 named missing too
    [whole] = hang_findings_in_groups(latest, last, 4, [[0, 1, 2, 3]], bare_steps=bare)
    assert whole.ranks == [0, 1, 3]


def test_every_rank_waiting_in_one_all_reduce_is_named_as_such(tmp_path: Path) -> None:
    """A comm hook whose future never completes: both ranks wait in the same all-reduce, none is
    missing. The report says so and points at the hook, the backend or the network, not at a
    missing rank (it said "missing: rank " with nobody named)."""
    script = Path(__file__).parent / "scripts" / "hook_never_completes.py"
    run_dir = tmp_path / "run"
    procs = _start_ranks(script, run_dir)
    try:
        deadline = time.monotonic() + 120
        finding = None
        while finding is None:
            assert time.monotonic() < deadline, "no hang finding naming both ranks within 120 s"
            assert all(p.poll() is None for p in procs), "a rank exited before the hang"
            if all((run_dir / f"rank-{r}-stuck").exists() for r in range(2)):
                report = ddpdoctor.analyze(ddpdoctor.load_run(run_dir))
                finding = next(
                    (f for f in report.findings if f.code == "hang" and f.severity == "error" and len(f.ranks) == 2),
                    None,
                )
            if finding is None:
                time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        stderr_of_rank0 = procs[0].stderr.read() if procs[0].stderr else b""
    assert finding.title.startswith("every rank waits in the all-reduce of bucket ")
    assert finding.title.endswith(" of step 2: no rank is missing, the collective does not complete")
    assert finding.ranks == [0, 1] and finding.evidence["missing"] == {} and "missing: rank" not in finding.title
    assert "comm hook" in finding.fix and "PowerSGD" in finding.fix
    assert b"or the collective does not complete" in stderr_of_rank0  # the rank's own warning says both


def test_a_waiting_buffer_broadcast_names_the_buffers_it_carries() -> None:
    from ddpdoctor.analysis.hang import hang_findings, hang_findings_in_groups

    buffers = ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    # rank 1 is missing from the broadcast of step 4
    latest = {0: _hang(0, "buffer broadcast", 4), 1: _hang(1, "between steps", 4)}
    [f] = hang_findings(latest, {0: 3, 1: 3}, 2, broadcast_buffers=buffers)
    assert f.ranks == [1] and f.evidence["broadcast_buffers"] == buffers
    assert (
        "the broadcast carries rank 0's module buffers (bn.running_mean, bn.running_var, bn.num_batches_tracked): "
        "DDP broadcasts them at each forward (broadcast_buffers)" in f.detail
    )
    # every rank waits in it: the finding names them too; per rank, as the report passes them
    both = {r: _hang(r, "buffer broadcast", 4) for r in (0, 1)}
    [g] = hang_findings_in_groups(both, {0: 3, 1: 3}, 2, [[0, 1]], broadcast_buffers={0: buffers, 1: buffers})
    assert g.title.startswith("every rank waits in the buffer broadcast of step 4")
    assert "It carries rank 0's module buffers (bn.running_mean, " in g.detail
    # an all-reduce that waits names its bucket, not the buffers
    [h] = hang_findings(
        {0: _hang(0, "allreduce", 4, pending_bucket=0), 1: _hang(1, "between steps", 4)},
        {0: 3, 1: 3},
        2,
        broadcast_buffers=buffers,
    )
    assert "bn.running_mean" not in h.detail and "broadcast_buffers" not in h.evidence
