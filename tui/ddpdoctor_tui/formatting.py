"""Number formats and status colours shared by the panels (one place, so they agree)."""

from __future__ import annotations

from rich.text import Text

#: Colour of each rank status: healthy ones quiet, the ones that need attention loud.
STATUS_STYLE: dict[str, str] = {
    "running": "green",
    "straggler": "bold dark_orange",
    "stalled": "bold yellow",
    "hung": "bold white on red",
    "finished": "cyan",
    "terminated": "magenta",
    "failed": "bold red",
    "lost": "bold red",
}

SEVERITY_STYLE: dict[str, str] = {"info": "cyan", "warning": "bold dark_orange", "error": "bold red"}

HEALTH_STYLE: dict[str, str] = {
    "waiting": "dim",
    "ok": "bold green",
    "warning": "bold dark_orange",
    "error": "bold white on red",
}


def ms(value: float | None, digits: int = 1) -> str:
    """Milliseconds, or a dash when the log does not tell."""
    return "-" if value is None else f"{value:.{digits}f}"


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.0f}M"


def status_text(status: str, width: int = 10) -> Text:
    """The status in its colour, padded so that a table column fits the longest one."""
    return Text(status.ljust(width), style=STATUS_STYLE.get(status, ""))


def lateness_colour(late_ms: float, threshold_ms: float) -> str:
    """Green (on time) through yellow to red (late by ``threshold_ms`` or more)."""
    t = max(0.0, min(1.0, late_ms / threshold_ms)) if threshold_ms > 0 else 0.0
    if t < 0.5:
        red, green = int(60 + 390 * t), 170
    else:
        red, green = 255, int(170 - 340 * (t - 0.5))
    return f"rgb({min(red, 255)},{max(green, 0)},40)"
