"""The watch app shell starts under Pilot and shows what it watches."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor_tui import WatchApp
from textual.widgets import Static


async def test_watch_shell_shows_the_run_dir_and_quits(tmp_path: Path) -> None:
    app = WatchApp(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        text = str(app.query_one("#placeholder", Static).render())
        assert str(tmp_path) in text
        await pilot.press("q")
    assert app.return_code == 0
