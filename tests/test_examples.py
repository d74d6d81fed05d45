"""The example script under torchrun: ranks from the environment, one shared run dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ddpdoctor
from tests.ddp_harness import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_example_under_torchrun_writes_one_file_per_rank(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DDPDOCTOR_RUN_DIR"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(ROOT / "examples" / "train_instrumented.py"),
            "--steps",
            "5",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ddpdoctor log: "))
    run = ddpdoctor.load_run(tmp_path / line.removeprefix("ddpdoctor log: "))
    assert sorted(run.ranks) == [0, 1]
    assert [run.ranks[r].header.local_rank for r in (0, 1)] == [0, 1]
    assert all(len(log.steps) == 5 and log.end is not None for log in run.ranks.values())
