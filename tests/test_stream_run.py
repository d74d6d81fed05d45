"""``ddpdoctor run --endpoint`` end to end: real torchrun ranks stream to ``ddpdoctor collect``, whose
run dir reports like the ranks' own; with the receiver down, training is unaffected and the
local log says what the stream lost."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import ddpdoctor
from ddpdoctor.events.line_index import is_index_line
from ddpdoctor.runlog.indexed import file_lines
from tests.ddp_harness import free_port, torchrun_cmd
from tests.test_run_cmd import EXAMPLES, _env, ddpdoctor_run


def test_streamed_run_collected_then_reported(tmp_path: Path) -> None:
    collector = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpdoctor",
            "collect",
            "--listen",
            "127.0.0.1:0",
            "--run-dir",
            str(tmp_path / "collected"),
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert collector.stdout is not None
        first = collector.stdout.readline()
        assert first.startswith("ddpdoctor collect: listening on 127.0.0.1:"), first
        port = int(first.split("listening on 127.0.0.1:")[1].split(",")[0])
        proc = ddpdoctor_run(
            tmp_path,
            torchrun_cmd(str(EXAMPLES / "torchrun_train.py"), "--steps", "6"),
            "--run-dir",
            "local",
            "--endpoint",
            f"127.0.0.1:{port}",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        collector.send_signal(signal.SIGINT)
        out, err = collector.communicate(timeout=30)
        assert collector.returncode == 0, err
    finally:
        collector.kill()
        collector.wait(timeout=30)
    assert "dropped by senders: 0, dropped here (reader behind): 0, lost in transit: 0" in out
    assert "refused over the limit of" in out and "the stream is incomplete" not in out
    local, collected = tmp_path / "local", tmp_path / "collected"
    names = sorted(p.name for p in local.iterdir())
    assert names == ["rank-00000.jsonl", "rank-00001.jsonl"]
    assert sorted(p.name for p in collected.iterdir()) == [*names, "receiver.json"]
    assert ddpdoctor.load_run(collected).receiver == (0, 0, 0, 0, 0, 0)
    for name in names:  # nothing dropped: the collected files hold the local ones' records, byte for byte
        assert _records(collected / name) == _records(local / name)
        assert file_lines(collected / name) is not None  # and the collector indexed them as the ranks do
    run = ddpdoctor.load_run(collected)
    assert all(len(log.steps) == 6 and log.end is not None for log in run.ranks.values())
    report = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "report", str(collected), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0 and '"findings"' in report.stdout


def test_receiver_down_training_unaffected_drops_logged_locally(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    proc = ddpdoctor_run(
        tmp_path,
        torchrun_cmd(str(EXAMPLES / "torchrun_train.py"), "--steps", "5"),
        "--run-dir",
        "local",
        "--endpoint",
        f"127.0.0.1:{port}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final loss" in proc.stdout
    run = ddpdoctor.load_run(tmp_path / "local")
    for log in run.ranks.values():
        assert len(log.steps) == 5 and log.end is not None  # the local file is complete
        # every record of the rank, but the drop notes themselves, was lost to the stream and counted
        assert log.stream_dropped >= len(log.steps) + 2
        assert not log.probes_off  # no probe of the training was switched off
    # the report says what the stream lost, and that it read everything from the files
    report = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "report", str(tmp_path / "local")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    total = sum(log.stream_dropped for log in run.ranks.values())
    assert f"the live stream dropped {total} records (by rank 0: " in report.stdout


def _records(path: Path) -> list[bytes]:
    """A rank file's record lines (its index lines are where each writer put them)."""
    return [line for line in path.read_bytes().splitlines() if not is_index_line(line)]
