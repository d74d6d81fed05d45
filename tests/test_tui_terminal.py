"""``ddpdoctor watch`` and ``ddpdoctor demo`` in a real terminal: tmux runs them, keys go in with
send-keys, the screen comes back with capture-pane. Skipped where tmux is not installed."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.test_live_run import write_run

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

ROOT = Path(__file__).resolve().parent.parent


class Terminal:
    """One tmux session on a private server socket (never touches the user's tmux)."""

    def __init__(self, command: str, width: int = 120, height: int = 40) -> None:
        self.socket = f"ddpdoctor-test-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, "TERM": "xterm-256color", "PYTHONPATH": str(ROOT)}
        self._tmux(
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            str(width),
            "-y",
            str(height),
            f"cd {shlex.quote(str(ROOT))} && {command}; echo EXITED rc=$?; sleep 600",
            env=env,
        )

    def _tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True, timeout=20, env=env
        ).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "t")

    def history(self) -> str:
        """Everything the pane printed, scrolled-off lines included."""
        return self._tmux("capture-pane", "-p", "-S", "-", "-t", "t")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def wait_for(self, text: str, timeout: float = 60.0, gone: bool = False) -> str:
        """The screen once ``text`` is on it (or, ``gone``, off it)."""
        what = f"{text!r} {'gone' if gone else 'shown'}"
        return self.wait_until(lambda screen: (text in screen) != gone, what, timeout)

    def wait_until(self, ready: Callable[[str], bool], what: str, timeout: float = 60.0) -> str:
        """The screen once ``ready(screen)``; polled: a terminal has no other way to tell."""
        deadline = time.monotonic() + timeout
        tick = threading.Event()
        while True:
            screen = self.screen()
            if ready(screen):
                return screen
            # the command ended: the screen can no longer change (fail now, not at the deadline)
            assert "EXITED rc=" not in screen, f"never {what}; the command exited; the screen:\n{screen}"
            assert time.monotonic() < deadline, f"never {what} in {timeout:.0f} s; the screen:\n{screen}"
            tick.wait(0.2)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=20, check=False)


QUIT_AT_STEP = 40


def _latest_step(screen: str) -> int:
    """The live view's latest step (its header's "(latest N)"), -1 before one is shown."""
    found = re.search(r"\(latest (\d+)\)", screen)
    return int(found.group(1)) if found else -1


def _log_summary(run_dir: Path) -> str:
    """Per rank file: its step records and its last line (how the rank ended)."""
    out = []
    for f in sorted(run_dir.glob("rank-*.jsonl")):
        lines = f.read_text().splitlines()
        steps = sum('"kind":"step"' in line for line in lines)
        last = lines[-1][:300] if lines else ""
        out.append(f"{f.name}: {steps} steps; last: {last}")
    return "\n".join(out) or "no rank files"


@pytest.fixture
def terminal() -> Iterator[list[Terminal]]:
    opened: list[Terminal] = []
    try:
        yield opened
    finally:
        for t in opened:
            t.close()


def test_watch_in_a_real_terminal(tmp_path: Path, terminal: list[Terminal]) -> None:
    run = write_run(tmp_path / "run", world=4, steps=30, straggler=2, end=None)
    term = Terminal(f"{shlex.quote(sys.executable)} -m ddpdoctor watch {shlex.quote(str(run))}")
    terminal.append(term)
    screen = term.wait_for("latest: rank 2 at b0")
    assert "ranks 4/4" in screen and "WARNING" in screen and "step 29 (latest 29)" in screen
    assert "straggler" in screen and "fix:" in screen
    term.keys("p")
    term.wait_for("[PAUSED]")
    term.keys("Left", "Left")
    screen = term.wait_for("step 27 (latest 29)")
    term.keys("?")
    screen = term.wait_for("filter findings")
    term.keys("Escape")
    # a key right after escape would read as alt+key: wait for the help to close first
    term.wait_for("filter findings", gone=True)
    term.keys("q")
    screen = term.wait_for("EXITED rc=0")


@pytest.mark.slow
def test_demo_opens_the_live_view_and_prints_the_report_on_quit(tmp_path: Path, terminal: list[Terminal]) -> None:
    run_dir = tmp_path / "demo"
    term = Terminal(
        f"{shlex.quote(sys.executable)} -m ddpdoctor demo --scenario straggler --steps 400 --pace 0.02 "
        f"--run-dir {shlex.quote(str(run_dir))}"
    )
    terminal.append(term)
    live = term.wait_for("arrives late at the step's collectives", timeout=120)
    assert "ranks 2/2" in live and "straggler" in live
    # The live view names a new straggler over its last 10 steps; the report weighs the whole
    # run, where one early hiccup of the other rank (a loaded machine) can outweigh a few late
    # steps. Quit once the run is long enough for the whole-run rule too.
    live = term.wait_until(lambda screen: _latest_step(screen) >= QUIT_AT_STEP, f"step {QUIT_AT_STEP}", timeout=120)
    assert "arrives late at the step's collectives" in live
    term.keys("q")
    screen = term.wait_for("EXITED rc=0", timeout=60)
    # the whole report (the screen holds its last 40 lines) and what the ranks wrote, on failure
    history = term.history()
    assert "stopped the training on your quit" in history and "straggler" in screen, (
        f"{history}\n--- the live view before the quit:\n{live}\n--- the rank logs:\n{_log_summary(run_dir)}"
    )
    # the ranks were stopped with SIGTERM, so each closed its log ("terminated" in the report)
    assert screen.count("terminated") >= 2


@pytest.mark.slow
def test_demo_view_stays_open_on_the_finished_run(tmp_path: Path, terminal: list[Terminal]) -> None:
    run_dir = tmp_path / "demo"
    term = Terminal(
        f"{shlex.quote(sys.executable)} -m ddpdoctor demo --steps 15 --pace 0 --run-dir {shlex.quote(str(run_dir))}"
    )
    terminal.append(term)
    screen = term.wait_for("[finished]", timeout=120)
    # header + each rank (the health word may be WARNING: on a loaded machine a rank can really lag)
    assert "ranks 2/2" in screen and screen.count("finished") >= 3, screen
    term.keys("q")
    screen = term.wait_for("EXITED rc=0", timeout=60)
    assert "stopped the training" not in screen and "15 steps, finished" in screen
