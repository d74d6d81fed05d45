"""The ``ddpdoctor watch`` application shell; panels arrive with the TUI issue."""

from __future__ import annotations

from pathlib import Path

from textual.app import App, ComposeResult
from textual.widgets import Footer, Header, Static


class WatchApp(App[None]):
    """Live view of a run dir (shell: shows what it watches)."""

    CSS_PATH = "watch_app.tcss"
    TITLE = "ddpdoctor watch"
    BINDINGS = [("q", "quit", "Quit")]

    def __init__(self, run_dir: Path | None = None) -> None:
        super().__init__()
        self.run_dir = run_dir

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"Watching {self.run_dir or '(nothing yet)'}", id="placeholder")
        yield Footer()
