"""One run dir written by two jobs launched one after another (``ddpdoctor run`` of two launches in
turn, a script that spawns its ranks twice): each rank file holds the first job's process, then
the second's, steps from 0 in each. The report reads the last job and says the others were there."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.cli.main import main
from ddpdoctor.runlog import load_run
from ddpdoctor.runlog.run import SAME_JOB_NS
from tests.ddp_harness import run_ranks

JOBS = ((3, 9), (2, 5))  # (world size, steps): the second job has fewer ranks and steps


def _job(rank: int, world_size: int, run_dir: str, steps: int) -> int:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    with ddpdoctor.instrument(ddp, run_dir=run_dir):
        for _ in range(steps):
            ddp(torch.randn(4, 8)).sum().backward()
    return steps


def _after_the_job_gap(run_dir: Path) -> None:
    """Return once more than ``SAME_JOB_NS`` has passed since the last End record in ``run_dir``.

    Jobs are told apart by time (``job_table``): a process that starts within that gap of the
    job before belongs to it. A launcher takes seconds to start a job; the fork server here starts
    ranks in a fraction of one, and a second job that began 0.93 s after the first ended was read
    as the same job (a flaky fixture, torch 2.5.1). Waits for that wall-clock gap, no longer."""
    ends = [log.end.t_wall_ns for log in load_run(run_dir).ranks.values() if log.end is not None]
    assert ends, "the first job wrote no End record"
    wait_s = (max(ends) + SAME_JOB_NS - time.time_ns()) / 1e9 + 0.05
    if wait_s > 0:
        time.sleep(wait_s)


@pytest.fixture(scope="module")
def reused(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("reused") / "run"
    for k, (world, steps) in enumerate(JOBS):
        if k:
            _after_the_job_gap(run_dir)
        run_ranks(_job, world, args=(str(run_dir), steps), timeout=120)
    return run_dir


@pytest.mark.parametrize("max_steps", [None, "auto"])
def test_the_last_job_is_read_alone(reused: Path, max_steps: Any) -> None:
    run = load_run(reused, max_steps=max_steps)
    # rank 2's file holds the first job only: left out, not reported as a rank of the second
    assert sorted(run.ranks) == [0, 1] and run.earlier_jobs == 1 and run.missing_ranks() == []
    for log in run.ranks.values():
        assert [s.step for s in log.steps] == list(range(JOBS[1][1])) and log.steps_total == JOBS[1][1]
        assert log.earlier_jobs == 1 and len(log.headers) == 1 and log.header is not None
        assert log.header.world_size == 2 and log.end is not None
    report = ddpdoctor.analyze(run)
    assert report.run["world_size"] == 2 and report.stats["steps"] == JOBS[1][1]
    assert report.run["earlier_jobs"] == 1


def test_the_report_says_the_earlier_jobs(reused: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(reused)]) == 0
    out = capsys.readouterr().out
    assert "world size 2," in out and f"{JOBS[1][1]} steps, finished" in out
    assert "the last of 2 jobs that wrote this run dir one after another" in out
    assert "--run-dir" in out


def test_the_live_view_follows_the_last_job(reused: Path) -> None:
    """Replayed file by file (rank 0's two jobs, then rank 1's, then rank 2's first job only)."""
    from tests.test_live_run import feed_all

    _, snap = feed_all(reused)
    assert snap.earlier_jobs == 1 and snap.world_size == 2 and [r.rank for r in snap.ranks] == [0, 1]
    assert snap.latest_step == JOBS[1][1] - 1 and snap.view_step == JOBS[1][1] - 1 and snap.finished


async def test_the_watch_header_says_it_shows_the_last_job(reused: Path) -> None:
    from ddpdoctor.runlog.source import DirSource
    from ddpdoctor_tui import WatchApp
    from ddpdoctor_tui.run_header import RunHeader
    from tests.test_tui_watch import SIZE, wait_for, widget_text

    app = WatchApp(DirSource(reused), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.finished)
        header = widget_text(app.query_one(RunHeader))
        assert "ranks 2/2" in header and "last of 2 jobs in this dir" in header, header


@pytest.mark.parametrize("max_steps", [None, "auto"])
def test_each_job_is_read_on_request(reused: Path, max_steps: Any) -> None:
    """``load_run(job=K)``: the earlier job, all three of its ranks (rank 2's file holds it alone);
    -1 is the last; a job that is not there is a clear error."""
    first = load_run(reused, max_steps=max_steps, job=0)
    assert sorted(first.ranks) == [0, 1, 2] and (first.earlier_jobs, first.later_jobs) == (0, 1)
    for log in first.ranks.values():
        assert [s.step for s in log.steps] == list(range(JOBS[0][1])) and log.steps_total == JOBS[0][1]
        assert len(log.headers) == 1 and log.header is not None and log.header.world_size == 3
        assert log.end is not None and log.end.steps == JOBS[0][1]
    assert len({log.header.pid for log in first.ranks.values() if log.header}) == 3
    last = load_run(reused, max_steps=max_steps, job=-1)
    assert sorted(last.ranks) == [0, 1] and (last.earlier_jobs, last.later_jobs) == (1, 0)
    assert [s.step for s in last.ranks[0].steps] == list(range(JOBS[1][1]))
    # the same processes as the default read of the last job
    default = load_run(reused, max_steps=max_steps)
    assert {r: log.header.pid for r, log in last.ranks.items() if log.header} == {
        r: log.header.pid for r, log in default.ranks.items() if log.header
    }
    with pytest.raises(ddpdoctor.RunDirError, match="no job 2 here"):
        load_run(reused, max_steps=max_steps, job=2)


def test_the_report_reads_an_earlier_job_with_job_k(reused: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(reused), "--job", "0"]) == 0
    out = capsys.readouterr().out
    assert "world size 3," in out and f"{JOBS[0][1]} steps, finished" in out
    assert "job 0 (from 0) of the 2 jobs that wrote this run dir" in out and "--job K" in out
    assert main(["report", str(reused), "--job", "5"]) == 2
    assert "no job 5 here (2 job(s) wrote it" in capsys.readouterr().err
