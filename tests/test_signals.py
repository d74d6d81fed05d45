"""ddpdoctor never changes how a process reacts to a signal: the preemption pattern under
``ddpdoctor run`` on real torchrun, with the user's handler installed before and after DDP is built."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import psutil
import pytest

import ddpdoctor
from ddpdoctor.cli.render_text import render
from tests.ddp_harness import torchrun_cmd

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "preempt_train.py"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DDPDOCTOR_", "TORCHELASTIC_"))}


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait(timeout=30)


def _wait_for(paths: list[Path], proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text() for p in paths):
        assert proc.poll() is None, f"ddpdoctor run ended early ({proc.returncode})"
        assert time.monotonic() < deadline, f"workers did not start training within {timeout} s"
        time.sleep(0.05)  # polling files written by the workers, with a deadline


CASES = [("after", "TERM"), ("before", "TERM"), ("after", "INT")]


def _preempt(out_dir: Path, when: str, signame: str) -> tuple[int | None, str, str]:
    """One preemption under ``ddpdoctor run``: start, signal each worker once it trained 3 steps,
    wait for the end; the whole tree is killed on the way out if it is still running."""
    cmd = torchrun_cmd(str(SCRIPT), str(out_dir), when, signame)
    argv = [sys.executable, "-m", "ddpdoctor", "run", "--run-dir", str(out_dir / "run"), "--", *cmd]
    proc = subprocess.Popen(
        argv,
        cwd=out_dir,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids = [out_dir / f"pid-{r}" for r in (0, 1)]
        _wait_for(pids, proc, timeout=120)
        for p in pids:  # as Slurm, Kubernetes and elastic scale-down do: each worker is signalled
            os.kill(int(p.read_text()), getattr(signal, f"SIG{signame}"))
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Future[Any]]]:
    """The three cases, each a real ``ddpdoctor run -- torchrun`` job of its own, run side by
    side (they share nothing but the machine; what they check does not depend on timing)."""
    root = tmp_path_factory.mktemp("preempt")
    with ThreadPoolExecutor(len(CASES)) as pool:
        jobs = {}
        for when, signame in CASES:
            out_dir = root / f"{when}-{signame}"
            out_dir.mkdir()
            jobs[(when, signame)] = (out_dir, pool.submit(_preempt, out_dir, when, signame))
        wait([job for _, job in jobs.values()])
    return jobs


@pytest.mark.parametrize(("when", "signame"), CASES)
def test_preemption_handler_runs_as_without_ddpdoctor(
    preempted: dict[tuple[str, str], tuple[Path, Future[Any]]], when: str, signame: str
) -> None:
    tmp_path, job = preempted[(when, signame)]
    returncode, out, err = job.result()
    assert returncode == 0, err[-3000:]
    assert (tmp_path / "checkpoint.pt").stat().st_size > 0
    trained = {int(r): int(n) for r, n in re.findall(r"rank (\d) steps (\d+)", out)}
    assert sorted(trained) == [0, 1] and trained[0] == trained[1] >= 3
    run = ddpdoctor.load_run(tmp_path / "run")
    assert sorted(run.ranks) == [0, 1]
    for rank, log in run.ranks.items():
        # monitored through the grace period, every step, and the log ends cleanly
        assert log.end is not None and log.end.reason in ("close", "exit"), log.end
        # the signal the handler caught is named: the run reads stopped by it, not finished
        assert log.end.signal == f"SIG{signame}", log.end
        assert log.end.steps == len(log.steps) == trained[rank]
        assert log.corrupt_lines == 0 and not log.torn_tail
    report = ddpdoctor.analyze(run)
    assert [r["status"] for r in report.ranks] == ["terminated", "terminated"]
    assert f"ranks 0, 1 caught SIG{signame} in the job's own handler and exited" in render(report)
