"""The bucket timeline: ranks x collectives of one step, arrival lateness as colour."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ddpdoctor.analysis.live_run import LiveSnapshot
from ddpdoctor.analysis.straggler import MIN_LATENESS_MS, MIN_LATENESS_SHARE
from ddpdoctor_tui.formatting import lateness_colour


class BucketHeatmap(Static):
    """One row per rank, one cell per collective (buffer broadcast, then buckets in firing order).

    The colour scale tops out at the straggler detector's own threshold, so red means "late
    enough to be named a straggler" and a healthy run stays green.
    """

    def show(self, snap: LiveSnapshot, selected: int | None) -> None:
        heat = snap.heatmap
        if heat is None:
            self.update(Text("no complete step yet: the heatmap needs every rank's bucket times", style="dim"))
            return
        step_ms = next((t.median_ms for t in reversed(snap.step_times) if t.step == heat.step), 0.0)
        threshold = max(MIN_LATENESS_MS, MIN_LATENESS_SHARE * step_ms)
        out = Text()
        out.append(f"step {heat.step}  arrival lateness (red >= {threshold:.0f} ms)\n", style="bold")
        out.append("rank  " + " ".join(f"{name[:5]:>5}" for name in heat.collectives) + "\n", style="dim")
        for rank, row in heat.late_ms.items():
            out.append(f"{rank:>4}  ", style="reverse" if rank == selected else "")
            for v in row:
                out.append(f"{v:5.0f}" if v >= 1.0 else "    .", style=f"black on {lateness_colour(v, threshold)}")
                out.append(" ")
            out.append("\n")
        worst = heat.worst()
        if worst is not None and worst[2] >= 1.0:
            rank, index, value = worst
            out.append(f"latest: rank {rank} at {heat.collectives[index]}, +{value:.1f} ms",
                       style="bold red" if value >= threshold else "")
        self.update(out)
