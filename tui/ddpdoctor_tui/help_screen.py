"""The key bindings, on a modal screen."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: tuple[tuple[str, str], ...] = (
    ("p / space", "pause: hold the view on the current step (again: follow the latest step)"),
    ("left / ,", "one step back in time (pauses)"),
    ("right / .", "one step forward in time"),
    ("end", "follow the latest step again"),
    ("up / down", "select a rank in the ranks table (rank detail and heatmap follow it)"),
    ("f", "filter findings: all, warning and worse, errors only"),
    ("s / click a header", "sort the ranks: cost to others, late, step, bwd, fwd, wait, rank, host (again: reversed)"),
    ("/", "filter the ranks by rank (3, 96-103) or host name (enter or escape closes it)"),
    ("n", "one row per host (medians of its ranks), or per rank again"),
    ("w", "above 16 ranks: the rank detail follows the worst rank again (after up/down picked one)"),
    ("?", "this help"),
    ("q", "quit"),
)

STATUSES: tuple[tuple[str, str], ...] = (
    ("running", "logging steps"),
    ("straggler", "costs the others material time at the collectives (live blame, last 64 steps)"),
    ("stalled", "the rank's hang watchdog saw no progress for hang_timeout"),
    ("hung", "stalled, and the hang detector says the run cannot go on"),
    ("finished / terminated / failed", "its log closed: normally, by a signal, by an exception"),
    ("lost", "its log stopped without an end while the others went on (killed)"),
)


class HelpScreen(ModalScreen[None]):
    """Key bindings and what the statuses mean; any of escape, ? or q closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        ("escape", "dismiss", "Close"),
        ("question_mark", "dismiss", "Close"),
        ("q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        keys = Table(title="keys", box=None, show_header=False)
        for key, what in KEYS:
            keys.add_row(f"[bold]{key}[/]", what)
        statuses = Table(title="rank status", box=None, show_header=False)
        for name, what in STATUSES:
            statuses.add_row(f"[bold]{name}[/]", what)
        with Vertical(id="help-box"):
            yield Static(keys)
            yield Static(statuses)
            yield Static("[dim]escape closes this help[/]")
