"""``ddpdoctor export RUN --tensorboard DIR`` on a real demo run (2 gloo ranks, a planted straggler),
read back with TensorBoard's own event reader."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddpdoctor.analysis.diagnose import diagnose
from ddpdoctor.cli.demo_training import STRAGGLER_DELAY_S
from ddpdoctor.cli.main import main
from ddpdoctor.integrations import tensorboard_export
from ddpdoctor.integrations.figures import RANK_FIGURES, RUN_FIGURES, StepFigures, blocks, step_figures
from ddpdoctor.integrations.follow import RunFollower, finding_key
from ddpdoctor.integrations.tensorboard_export import finding_markdown
from ddpdoctor.runlog import load_run
from tests.ddp_harness import run_tree
from tests.test_integrations import _env, _events, _missing

STEPS = 30

pytestmark = pytest.mark.skipif(bool(_missing("tensorboard")), reason=_missing("tensorboard") or "-")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ddpdoctor demo --headless --scenario straggler``: the last rank's backward is slower."""
    folder = tmp_path_factory.mktemp("export-demo")
    argv = [sys.executable, "-m", "ddpdoctor", "demo", "--headless", "--scenario", "straggler"]
    proc = run_tree([*argv, "--steps", str(STEPS), "--run-dir", "run"], folder, _env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "run"


def test_export_writes_every_rank_and_the_run(
    demo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tb"
    assert main(["export", str(demo_run), "--tensorboard", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"2 rank(s) x {STEPS} point(s) (every step)" in printed
    ranks = {r: _events(out / f"rank_{r}") for r in (0, 1)}
    for acc in ranks.values():
        for name in RANK_FIGURES:
            values = acc.Scalars(f"ddpdoctor/{name}")
            assert len(values) >= STEPS - 1, name  # the last step's duration ends at close
            assert [v.step for v in values] == sorted(v.step for v in values)
    run = _events(out / "run")
    for name in RUN_FIGURES:
        assert len(run.Scalars(f"ddpdoctor/{name}")) >= STEPS - 1
    # the planted straggler shows in rank 1's lateness. (How late it is at each step depends on
    # the host's load: on a busy 2-core machine rank 0 is sometimes the later one. The values are
    # the analysis's, value for value: the next test; a steady straggler: test_integrations.py.)
    late = {r: [e.value for e in acc.Scalars("ddpdoctor/lateness_ms")] for r, acc in ranks.items()}
    assert max(late[1]) > STRAGGLER_DELAY_S * 1000 / 2, late
    # each point at its step's wall time, so TensorBoard's time axis is the run's
    loaded = load_run(demo_run)
    first = loaded.ranks[0].steps[0]
    assert abs(ranks[0].Scalars("ddpdoctor/step_ms")[0].wall_time - first.t0_wall_ns / 1e9) < 1.0
    # the findings: the report's, each as text at the step it was first seen
    findings = diagnose(loaded)
    assert findings  # (on this demo: the straggler, or the bucket size that would hide its wait)
    written = [(e.step, e.tensor_proto.string_val[0].decode()) for e in run.Tensors("ddpdoctor/findings/text_summary")]
    last = STEPS - 1  # a finding of the whole run, without a step, at the last one
    assert sorted(written) == sorted((last if f.step is None else f.step, finding_markdown(f)) for f in findings)


def test_export_figures_are_the_analysis_figures(demo_run: Path, tmp_path: Path) -> None:
    """What the export writes is ``figures.step_figures`` of the loaded run, value for value."""
    out = tmp_path / "tb"
    assert main(["export", str(demo_run), "--tensorboard", str(out)]) == 0
    run = load_run(demo_run, max_steps="auto")
    expected = step_figures(
        {r: log.steps for r, log in run.ranks.items()}, {r: log.header for r, log in run.ranks.items()}
    )
    acc = _events(out / "rank_1")
    written = {e.step: e.value for e in acc.Scalars("ddpdoctor/allreduce_wait_ms")}
    want = {sf.step: sf.ranks[1]["allreduce_wait_ms"] for sf in expected if "allreduce_wait_ms" in sf.ranks.get(1, {})}
    assert written.keys() == want.keys()
    assert all(abs(written[k] - want[k]) < 1e-3 for k in want)


def test_export_refuses_a_folder_with_events(
    demo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tb"
    assert main(["export", str(demo_run), "--tensorboard", str(out)]) == 0
    before = sorted(p.stat().st_size for p in out.rglob("*") if p.is_file())
    capsys.readouterr()
    assert main(["export", str(demo_run), "--tensorboard", str(out)]) == 2
    assert "already holds TensorBoard event files" in capsys.readouterr().err
    assert sorted(p.stat().st_size for p in out.rglob("*") if p.is_file()) == before  # nothing lost or added


def test_export_of_a_missing_run_dir_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "nope"), "--tensorboard", str(tmp_path / "tb")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "tb").exists()


def test_a_long_run_is_written_in_blocks(demo_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``EVERY_STEP_UPTO`` steps, one point per block of the compact log's window (8 here)."""
    monkeypatch.setattr(tensorboard_export, "EVERY_STEP_UPTO", 8)
    monkeypatch.setattr(tensorboard_export, "WINDOW_ROWS", 8)
    out = tmp_path / "tb"
    done = tensorboard_export.export_tensorboard(load_run(demo_run, max_steps="auto"), out)
    assert (done.block, done.points) == (8, -(-STEPS // 8))
    late = _events(out / "rank_1").Scalars("ddpdoctor/lateness_ms")
    assert [e.step for e in late] == [7, 15, 23, STEPS - 1]


def test_blocks_sum_up_each_figure_as_documented() -> None:
    steps = [
        StepFigures(0, 10.0, {0: {"step_ms": 10.0, "lateness_ms": 1.0}}, {"lost_to_stragglers_ms": 2.0}),
        StepFigures(1, 11.0, {0: {"step_ms": 20.0, "lateness_ms": 5.0}}, {"lost_to_stragglers_ms": 3.0}),
        StepFigures(2, 12.0, {0: {"step_ms": 30.0, "lateness_ms": 0.0}}, {"slowest_step_ms": 30.0}),
    ]
    first, second = blocks(steps, 2)
    assert (first.step, first.wall_s) == (1, 10.0)
    assert first.ranks[0] == {"step_ms": 15.0, "lateness_ms": 5.0}  # mean; max
    assert first.run == {"lost_to_stragglers_ms": 5.0}  # sum
    assert second.step == 2 and second.run == {"slowest_step_ms": 30.0}
    assert blocks(steps, 1) == steps


def test_the_export_command_in_a_process_of_its_own(demo_run: Path, tmp_path: Path) -> None:
    """The command as a user runs it, in a process of its own."""
    argv = [sys.executable, "-m", "ddpdoctor", "export", str(demo_run), "--tensorboard", str(tmp_path / "tb")]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tensorboard --logdir" in proc.stdout


def test_the_callbacks_reader_follows_a_run_dir(demo_run: Path, tmp_path: Path) -> None:
    """Rank 0's reader (``follow.RunFollower``) gives the figures ``export`` writes, each step once,
    and each finding once; a torn or garbage line in a rank file is skipped, not fatal."""
    copy = tmp_path / "run"
    shutil.copytree(demo_run, copy)
    with (copy / "rank-00001.jsonl").open("a") as f:
        f.write('not json at all\n{"torn')
    follower = RunFollower(copy)
    try:
        follower.poll()
        first = follower.take()
        follower.poll()
        again = follower.take()
    finally:
        follower.close()
    assert follower.error is None
    assert [sf.step for sf in first.steps] == list(range(STEPS))
    run = load_run(demo_run)
    headers = {r: log.header for r, log in run.ranks.items()}
    expected = step_figures({r: log.steps for r, log in run.ranks.items()}, headers)
    late = [sf.ranks[1].get("lateness_ms") for sf in expected]
    assert [sf.ranks[1].get("lateness_ms") for sf in first.steps] == late
    assert len({finding_key(f) for f in first.findings}) == len(first.findings)
    assert again.steps == [] and again.findings == []
