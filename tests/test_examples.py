"""The example script under torchrun: ranks from the environment, one shared run dir."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import ddpdoctor
from tests.ddp_harness import torchrun_cmd

ROOT = Path(__file__).resolve().parents[1]


def test_example_under_torchrun_writes_one_file_per_rank(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DDPDOCTOR_RUN_DIR"}
    proc = subprocess.run(
        torchrun_cmd(str(ROOT / "examples" / "train_instrumented.py"), "--steps", "5"),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]  # no rank aborts at teardown
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ddpdoctor log: "))
    run = ddpdoctor.load_run(tmp_path / line.removeprefix("ddpdoctor log: "))
    assert sorted(run.ranks) == [0, 1]
    assert [run.ranks[r].header.local_rank for r in (0, 1)] == [0, 1]
    assert all(len(log.steps) == 5 and log.end is not None for log in run.ranks.values())


def test_exit_right_after_backward_never_aborts(tmp_path: Path) -> None:
    # exit codes are the training's: three runs (side by side), each rank exits 0, none aborts at teardown
    env = {k: v for k, v in os.environ.items() if k != "DDPDOCTOR_RUN_DIR"}

    def attempt(run_dir: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            torchrun_cmd(str(ROOT / "tests" / "scripts" / "exit_after_backward.py"), str(run_dir)),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    run_dirs = [tmp_path / f"run-{i}" for i in range(3)]
    with ThreadPoolExecutor(len(run_dirs)) as pool:
        procs = list(pool.map(attempt, run_dirs))
    for run_dir, proc in zip(run_dirs, procs, strict=True):
        assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = ddpdoctor.load_run(run_dir)
        assert sorted(run.ranks) == [0, 1]
        assert all(
            log.end is not None and log.end.reason == "exit" and len(log.steps) == 3 for log in run.ranks.values()
        )


def test_ddpdoctor_calls_hold_no_backward_context() -> None:
    # torch 2.13+ stashes a contextvars Context in thread-local state during backward; the calls
    # ddpdoctor's comm hook makes there run without it, and it is back afterwards
    from ddpdoctor.runtime import torch_compat

    if not hasattr(torch_compat.torch._C, "_remove_obj_from_tls"):
        pytest.skip(f"torch {torch_compat.TORCH_VERSION} stashes no context during backward")
    import torch

    seen: list[tuple[bool, bool, bool]] = []

    def inside(_grad: torch.Tensor) -> None:
        before = torch._C._is_key_in_tls("context")
        during = torch_compat.without_backward_context(torch._C._is_key_in_tls, "context")
        seen.append((before, during, torch._C._is_key_in_tls("context")))

    x = torch.ones(2, requires_grad=True)
    x.register_hook(inside)
    (x * 2).sum().backward()
    assert seen == [(True, False, True)]
    assert not torch._C._is_key_in_tls("context")
