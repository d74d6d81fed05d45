"""A rank killed with SIGKILL mid-run: the report says which and when; the others' data is intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import ddpdoctor
from tests.ddp_harness import free_port

SCRIPT = Path(__file__).parent / "scripts" / "lose_a_rank.py"


def test_a_killed_rank_is_reported_lost(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_PORT=str(port)),
        )
        for r in range(2)
    ]
    try:
        assert procs[1].wait(timeout=120) == -signal.SIGKILL
        assert procs[0].wait(timeout=120) != 0  # its collectives time out without rank 1
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    run = ddpdoctor.load_run(tmp_path)
    report = ddpdoctor.analyze(run)
    lost = {f.code: f for f in report.findings}["rank-lost"]
    assert lost.ranks == [1] and lost.severity == "error"
    steps_1 = [s.step for s in run.ranks[1].steps]
    assert len(steps_1) >= 5 and steps_1 == list(range(len(steps_1)))  # what it wrote before dying, in order
    assert lost.step == steps_1[-1] and lost.evidence["seconds_before_others_ended"] >= 0
    statuses = {r["rank"]: r["status"] for r in report.ranks}
    assert statuses == {0: "failed", 1: "lost"}
    assert run.ranks[1].corrupt_lines <= 1  # at most the line torn by the kill
    # rank 0's log is whole: it went on until its collectives timed out, and closed
    assert run.ranks[0].end is not None and len(run.ranks[0].steps) >= len(steps_1)
