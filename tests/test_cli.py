"""The command line as a user runs it: demo, report (text/json, -o, --fail-on), errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpdoctor.cli.main import main


def _ddpdoctor(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddpdoctor", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_run(
    headless_demo: tuple[Path, subprocess.CompletedProcess[str]],
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The session's headless demo run (tests/conftest.py): 2 ranks, 8 steps."""
    return headless_demo


def test_demo_headless_trains_and_prints_a_per_rank_summary(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    assert f"run dir: {run_dir}" in proc.stdout
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank-00000.jsonl", "rank-00001.jsonl"]
    lines = proc.stdout.splitlines()
    table = lines[lines.index("Per-rank medians (ms):") + 1 :]
    assert table[0].split()[:4] == ["rank", "host", "steps", "status"]
    assert table[1].split()[0] == "0" and table[2].split()[0] == "1"
    assert table[1].split()[2] == "8" and table[1].split()[3] == "finished"
    assert "[warning]" not in proc.stdout and "[error]" not in proc.stdout  # healthy: info at most


def test_report_json_has_the_design_shape(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    run_dir, _ = demo_run
    out = tmp_path / "report.json"
    assert main(["report", str(run_dir), "--format", "json", "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report) == ["schema_version", "run", "ranks", "stats", "findings"]
    assert report["run"]["world_size"] == 2 and report["run"]["backend"] == "gloo" and report["run"]["finished"]
    assert report["run"]["ddp_options"]["broadcast_buffers"] is True
    for rank in report["ranks"]:
        medians = rank["medians_ms"]
        assert set(medians) >= {"step", "forward", "backward", "buffer_sync", "bucket_wait", "exposed_comm"}
        assert medians["step"] > 0 and medians["forward"] > 0 and medians["backward"] > 0
        assert medians["buffer_sync"] > 0 and medians["bucket_wait"] >= 0 and medians["exposed_comm"] >= 0
        assert rank["steps"] == 8 and rank["buckets"] >= 2
    assert {f["severity"] for f in report["findings"]} <= {"info"}


def test_report_text_and_fail_on(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = demo_run
    assert main(["report", str(run_dir), "--fail-on", "warning"]) == 0  # a healthy run has nothing to fail on
    text = capsys.readouterr().out
    assert text.startswith(f"ddpdoctor report: {run_dir}")
    assert "world size 2, backend gloo" in text and "Buckets:" in text


def test_report_on_a_bad_dir_is_a_clear_error_exit_2(tmp_path: Path) -> None:
    proc = _ddpdoctor("report", str(tmp_path / "nope"), timeout=60)
    assert proc.returncode == 2
    assert "no such directory" in proc.stderr and "Traceback" not in proc.stderr
    proc = _ddpdoctor("report", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "no rank files" in proc.stderr


def test_report_markdown(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = demo_run
    assert main(["report", str(run_dir), "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert md.startswith(f"# ddpdoctor report: `{run_dir}`")
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| rank | host | steps | status | step |") and len(table) == 3
    assert "## Findings" in md


def test_trace_is_a_valid_chrome_trace_with_aligned_ranks(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    run_dir, _ = demo_run
    out = tmp_path / "trace.json"
    assert main(["trace", str(run_dir), "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["ph"] for e in events} == {"X", "M"}
    assert {e["pid"] for e in slices} == {0, 1}
    for e in slices:
        assert isinstance(e["name"], str) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 0
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {n for _, n in names} == {"rank 0 (vm)", "rank 1 (vm)"} or len(names) == 2
    run = __import__("ddpdoctor").load_run(run_dir)
    for rank, log in run.ranks.items():
        mine = [e for e in slices if e["pid"] == rank]
        assert sum(e["name"] == "forward" for e in mine) == len(log.steps) == 8
        assert sum(e["name"].startswith("all-reduce bucket") for e in mine) == sum(len(s.b_done_us) for s in log.steps)
        # slices on one track nest or follow each other, never cross (what trace viewers require)
        for tid in {e["tid"] for e in mine}:
            track = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["tid"] == tid)
            stack: list[float] = []
            for start, end in track:
                while stack and start >= stack[-1] - 1e-3:
                    stack.pop()
                assert not stack or end <= stack[-1] + 1e-3
                stack.append(end)
    # all ranks leave a bucket's all-reduce together: on the aligned clock their ends coincide
    ends = {}
    for e in slices:
        if e["name"].startswith("all-reduce bucket"):
            ends.setdefault((e["args"]["step"], e["name"]), []).append(e["ts"] + e["dur"])
    gaps = sorted(max(v) - min(v) for v in ends.values() if len(v) == 2)
    assert gaps and gaps[len(gaps) // 2] < 2000  # µs
