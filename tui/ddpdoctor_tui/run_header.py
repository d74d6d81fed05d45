"""The run header: what is watched, its size and speed, and one word for its health."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ddpdoctor.analysis.groups import groups_text
from ddpdoctor.analysis.live_view import LiveSnapshot
from ddpdoctor_tui.formatting import HEALTH_STYLE


class RunHeader(Static):
    """Run, world size (and its DDP groups, where DDP runs over subgroups of the world), backend,
    elastic attempt, steps/s, overall health, and where the view is."""

    def show(self, snap: LiveSnapshot, paused: bool) -> None:
        """Render ``snap``; ``paused`` says the view is held on one step instead of following."""
        line = Text()
        line.append(" ddpdoctor ", style="bold reverse")
        line.append(f" {snap.run_id or '(no header yet)'} ", style="bold")
        line.append(f" ranks {len(snap.ranks)}/{snap.world_size}")
        if snap.ddp_groups:  # lateness and blame are within each group: say which ranks those are
            line.append(f" {groups_text(snap.ddp_groups)}")
        if len(snap.ddp_models) > 1 or snap.ddp:  # each process wrapped several models: which one this is
            others = ", ".join(str(m) for m in snap.ddp_models if m != snap.ddp)
            line.append(f"  DDP model {snap.ddp} (others: {others or 'none'}; watch --ddp K)", style="bold")
        if snap.backend:
            line.append(f"  {snap.backend}/{snap.device}")
        if snap.earlier_jobs:  # launches one after another into one run dir: the last one shown
            line.append(f"  last of {snap.earlier_jobs + 1} jobs in this dir", style="bold yellow")
        if snap.attempt:  # torchrun restarted the workers: this view is the newest attempt only
            line.append(f"  attempt {snap.attempt} (restarted)", style="bold yellow")
        rate = "-" if snap.steps_per_s is None else f"{snap.steps_per_s:.1f}"
        line.append(f"  {rate} steps/s  ")
        health = "finished" if snap.finished and snap.health == "ok" else snap.health
        line.append(f" {health.upper()} ", style=HEALTH_STYLE.get(snap.health, ""))
        second = Text(f" {snap.label}  ", style="dim")
        if snap.view_step is None:
            second.append("waiting for steps from every rank", style="italic")
        else:
            mode = "PAUSED" if paused else ("finished" if snap.finished else "live")
            second.append(f"step {snap.view_step}", style="bold")
            second.append(f" (latest {snap.latest_step}) [{mode}]")
        src = snap.source
        if src.problems():
            second.append(f"  skipped: {', '.join(src.problems())}", style="yellow")
        self.update(Text("\n").join([line, second]))
