"""The command line around the live view: ``watch`` errors, and the demo's straggler scenario."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ddpdoctor


def _ddpdoctor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpdoctor", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("watch", "{tmp}/nope"), "no such directory"),
        (("watch",), "give a run dir to watch, or --listen HOST:PORT"),
        (("watch", "--listen", "localhost"), "--listen wants HOST:PORT"),
        (("watch", "--listen", "127.0.0.1:99999"), "--listen wants HOST:PORT"),
        (("watch", "{tmp}", "--listen", "127.0.0.1:7777"), "not both"),
    ],
)
def test_watch_says_what_is_wrong_and_exits_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    done = _ddpdoctor(*(a.format(tmp=tmp_path) for a in args))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_demo_straggler_scenario_names_the_last_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    done = _ddpdoctor(
        "demo",
        "--headless",
        "--scenario",
        "straggler",
        "--ranks",
        "2",
        "--steps",
        "12",
        "--run-dir",
        str(run_dir),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert "straggler: rank 1" in done.stdout
    f = next(f for f in ddpdoctor.analyze(ddpdoctor.load_run(run_dir)).findings if f.code == "straggler")
    assert f.ranks == [1] and f.evidence["phase"] == "backward"
