"""The run header: what is watched, its size and speed, and one word for its health."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ddpdoctor.analysis.groups import groups_text
from ddpdoctor.analysis.live_view import LiveSnapshot, OutOfLine, hosts_text
from ddpdoctor_tui.formatting import HEALTH_STYLE


class RunHeader(Static):
    """Run, world size (and its DDP groups, where DDP runs over subgroups of the world), backend,
    elastic attempt, steps/s, overall health, and where the view is."""

    def show(self, snap: LiveSnapshot, paused: bool, judged: OutOfLine | None = None) -> None:
        """Render ``snap``; ``paused`` says the view is held on one step instead of following;
        ``judged``: the ranks and hosts out of line, a third line (at hundreds of ranks)."""
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
        if judged is not None:  # many ranks: their hosts in a few words
            line.append(f"  {hosts_text(r.host for r in snap.ranks if r.host)}")
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
        lines = [line, second]
        if judged is not None:
            lines.append(_out_of_line_text(judged))
        self.styles.height = len(lines)
        self.update(Text("\n").join(lines))


#: At most this many ranks and hosts out of line are named in the header.
NAMED = 6


def _out_of_line_text(judged: OutOfLine) -> Text:
    """ " out of line (10 of 256 ranks, 1 hosts): rank 77 (straggler, cost 632 ms, ...), host node012 (...)" """
    total = judged.within + len(judged.order)
    text = Text(f" out of line ({len(judged.order)} of {total} ranks, {len(judged.hosts)} hosts): ", style="bold")
    parts: list[tuple[str, str]] = []
    for o in judged.ranks:
        why = o.status or ("straggler" if o.named else "")
        numbers = ", ".join(f"{k} +{v:.1f}" for k, v in sorted(o.excess_ms.items(), key=lambda kv: -kv[1])[:2])
        words = ", ".join(w for w in (why, f"cost {o.cost_ms:.0f} ms" if o.cost_ms else "", numbers) if w)
        parts.append((f"rank {o.key} ({words})", "bold dark_orange" if o.named or o.status else ""))
    for h in judged.hosts:
        numbers = ", ".join(f"{k} +{v:.1f}" for k, v in sorted(h.excess_ms.items(), key=lambda kv: -kv[1])[:2])
        parts.append((f"host {h.key} ({numbers})", "dark_orange"))
    if not parts:
        text.append("none", style="green")
    for i, (words, style) in enumerate(parts[:NAMED]):
        text.append((", " if i else "") + words, style=style)
    if len(parts) > NAMED:
        text.append(f", {len(parts) - NAMED} more (s: sort, n: per host)", style="dim")
    return text
