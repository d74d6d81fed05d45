"""Snapshot tests of ``ddpdoctor watch`` at a fixed terminal size, on deterministic synthetic runs.

Each screen is compared with ``tests/tui_snapshots/<name>.txt`` (plain text: reviewable in a
diff) and ``<name>.ansi`` (the same with colours, which carry the statuses and the heatmap).
pytest-textual-snapshot is not used: it would pin pytest below 9. After an intended change of
the UI, regenerate with ``DDPDOCTOR_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_tui_snapshots.py``
and review the diff.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from textual.app import App
from textual.pilot import Pilot

from ddpdoctor.runlog import DirSource
from ddpdoctor_tui import WatchApp
from tests.test_live_run import write_run
from tests.test_tui_watch import SIZE, at_step, wait_for

SNAPSHOTS = Path(__file__).parent / "tui_snapshots"
UPDATE = os.environ.get("DDPDOCTOR_UPDATE_SNAPSHOTS") == "1"


def _screen(app: App[Any]) -> tuple[str, str]:
    width, height = app.size
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        record=True,
        force_terminal=True,
        color_system="truecolor",
        legacy_windows=False,
    )
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(clear=False), console.export_text(styles=True)


async def _settled_screen(pilot: Pilot[Any], app: App[Any], timeout: float = 10.0) -> tuple[str, str]:
    """The screen once two renders in a row agree: a snapshot the app has taken in is drawn at
    the next refresh (a DataTable re-measures a widened column then, not when the cell changes)."""
    deadline = time.monotonic() + timeout
    await pilot.pause()
    last = _screen(app)
    while True:
        await pilot.pause(0.05)
        now = _screen(app)
        if now == last:
            return now
        assert time.monotonic() < deadline, "the screen never settled"
        last = now


async def assert_snapshot(pilot: Pilot[Any], app: App[Any], name: str) -> None:
    text, ansi = await _settled_screen(pilot, app)
    paths = {SNAPSHOTS / f"{name}.txt": text, SNAPSHOTS / f"{name}.ansi": ansi}
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        for path, content in paths.items():
            path.write_text(content, encoding="utf-8")
        return
    for path, content in paths.items():
        if not path.exists():
            pytest.fail(f"no snapshot {path.name}: run with DDPDOCTOR_UPDATE_SNAPSHOTS=1 and review it")
        assert content == path.read_text(encoding="utf-8"), f"{path.name} differs: here is the screen now\n{text}"


def _app(directory: Path) -> WatchApp:
    source = DirSource(directory)
    source.label = "runs/synthetic"  # the tmp path would differ on every run
    return WatchApp(source, interval=0.05)


async def test_snapshot_straggler(tmp_path: Path) -> None:
    app = _app(write_run(tmp_path / "run", world=6, steps=40, straggler=4, end=None))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 39))
        await assert_snapshot(pilot, app, "straggler")


async def test_snapshot_stepped_back_with_a_rank_selected(tmp_path: Path) -> None:
    app = _app(write_run(tmp_path / "run", world=4, steps=30, straggler=1, straggle_from=20))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 29))
        await pilot.press("down")
        for _ in range(8):
            await pilot.press("left")
        await wait_for(pilot, at_step(app, 21))
        await assert_snapshot(pilot, app, "stepped_back")


async def test_snapshot_hang(tmp_path: Path) -> None:
    app = _app(write_run(tmp_path / "run", world=3, steps=20, hang_at=12))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.health == "error")
        await pilot.press("down", "down")
        await assert_snapshot(pilot, app, "hang")


async def test_snapshot_help(tmp_path: Path) -> None:
    app = _app(write_run(tmp_path / "run", world=2, steps=10))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 9))
        await pilot.press("question_mark")
        await pilot.pause()
        await assert_snapshot(pilot, app, "help")
