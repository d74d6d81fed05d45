"""Step time over time: min / median / max across ranks per complete step."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from ddpdoctor.analysis.live_view import LiveSnapshot


class StepChart(Vertical):
    """Two sparklines (slowest rank and median rank) over the retained steps, and the viewed step's numbers."""

    def compose(self) -> ComposeResult:
        yield Static(id="chart-label")
        yield Sparkline([], id="chart-max", min_color="green", max_color="red")
        yield Sparkline([], id="chart-median", min_color="green", max_color="yellow")

    def show(self, snap: LiveSnapshot) -> None:
        times = snap.step_times[-120:]
        label = Text()
        if not times:
            label.append("no complete step yet", style="dim")
        else:
            t = next((x for x in times if x.step == snap.view_step), times[-1])
            label.append(f"step {t.step}: ", style="bold")
            label.append(f"min {t.min_ms:.1f}  median {t.median_ms:.1f}  max {t.max_ms:.1f} ms")
        self.border_subtitle = f"top: max, bottom: median, last {len(times)} steps" if times else ""
        self.query_one("#chart-label", Static).update(label)
        self.query_one("#chart-max", Sparkline).data = [t.max_ms for t in times]
        self.query_one("#chart-median", Sparkline).data = [t.median_ms for t in times]
