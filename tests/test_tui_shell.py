"""The watch app starts under Pilot on an empty run dir, says what it watches, and quits."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor_tui import WatchApp
from ddpdoctor_tui.run_header import RunHeader
from tests.test_tui_watch import wait_for


async def test_watch_shell_shows_the_run_dir_and_quits(tmp_path: Path) -> None:
    app = WatchApp(tmp_path, interval=0.05)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None)
        text = str(app.query_one(RunHeader).render())
        assert str(tmp_path) in text and "waiting" in text
        await pilot.press("q")
    assert app.return_code == 0
