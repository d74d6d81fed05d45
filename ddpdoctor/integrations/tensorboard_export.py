"""A run dir as TensorBoard event files, written with TensorBoard's own writer (``ddpdoctor export``).

Layout: one TensorBoard run per rank (``rank_0``, ``rank_1``, ...) holding the per-rank figures
under the same tags (``ddpdoctor/step_ms``, ``ddpdoctor/lateness_ms``, ...), so TensorBoard draws
every rank's line in one chart per figure; and a ``run`` folder with the per-run figures
(``ddpdoctor/slowest_step_ms``, ``ddpdoctor/lost_to_stragglers_ms``) and the findings as text
(``ddpdoctor/findings``) at the step each was first seen. Each point carries its step's wall time.

A run of more than ``EVERY_STEP_UPTO`` steps is written one point per block of the compact log's
window (``sinks.compact.WINDOW_ROWS`` steps: ``figures.blocks``), not every step of every rank;
the run is read as ``ddpdoctor report`` reads it (``load_run(max_steps="auto")``), so a very long
or very wide run stays within a bounded memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpdoctor.analysis.diagnose import diagnose
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.errors import OutputError
from ddpdoctor.integrations.figures import StepFigures, blocks, step_figures
from ddpdoctor.runlog import Run
from ddpdoctor.sinks.compact import WINDOW_ROWS

#: Up to this many steps per rank, every step is a point; above, one point per ``WINDOW_ROWS`` steps.
EVERY_STEP_UPTO = 2048
#: Tag prefix of every series ddpdoctor writes (a section of its own in TensorBoard).
PREFIX = "ddpdoctor"


class ExportError(OutputError, ValueError):
    """The export cannot be written (the message says why); nothing was written."""


@dataclass
class Exported:
    """What an export wrote."""

    directory: Path
    ranks: list[int] = field(default_factory=list)
    points: int = 0  # points per rank (steps, or blocks of steps)
    block: int = 1  # steps per point
    scalars: int = 0  # scalar values written, all series together
    findings: int = 0
    corrupt_lines: int = 0  # lines of the rank files that could not be read (skipped)


def summary_writer(directory: str | os.PathLike[str]) -> Any:
    """TensorBoard's writer (``torch.utils.tensorboard.SummaryWriter``) on ``directory``;
    ``ExportError`` naming the extra to install when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ExportError(
            f"writing TensorBoard event files needs the tensorboard package ({exc}): "
            "pip install 'ddpdoctor[tensorboard]'"
        ) from exc
    return SummaryWriter(log_dir=str(directory))


def finding_markdown(f: Finding) -> str:
    """One finding as the text TensorBoard (and the trainers' loggers) show: Markdown."""
    ranks = f" (rank{'s' if len(f.ranks) > 1 else ''} {', '.join(map(str, f.ranks))})" if f.ranks else ""
    parts = [f"**{f.severity}** `{f.code}`{ranks}: {f.title}", f.detail]
    if f.fix:
        parts.append(f"Fix: {f.fix}")
    return "\n\n".join(p for p in parts if p)


def _has_events(directory: Path) -> bool:
    if not directory.exists():
        return False
    return any(name.startswith("events.out.tfevents") for _, _, names in os.walk(directory) for name in names)


def export_tensorboard(run: Run, directory: str | os.PathLike[str]) -> Exported:
    """Write ``run`` (as ``load_run`` read it) as TensorBoard event files under ``directory``.

    Refuses (``ExportError``) a folder that already holds event files: TensorBoard would mix the
    two exports' points in one chart."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: not a directory")
    if _has_events(out):
        raise ExportError(f"{out} already holds TensorBoard event files; give an empty or new folder")
    headers = {r: log.header for r, log in run.ranks.items()}
    per_step = step_figures({r: log.steps for r, log in run.ranks.items()}, headers)
    longest = max((len(log.steps) for log in run.ranks.values()), default=0)
    block = WINDOW_ROWS if longest > EVERY_STEP_UPTO else 1
    points = blocks(per_step, block)
    findings = diagnose(run)
    done = Exported(directory=out, ranks=sorted(run.ranks), points=len(points), block=block)
    done.corrupt_lines = run.corrupt_lines
    last_step = points[-1].step if points else 0
    writers: dict[str, Any] = {}
    try:
        for name in [*(f"rank_{r}" for r in done.ranks), "run"]:
            writers[name] = summary_writer(out / name)
        for sf in points:
            done.scalars += _write_point(writers, sf)
        run_writer = writers["run"]
        for f in findings:
            step = f.step if f.step is not None else last_step
            run_writer.add_text(f"{PREFIX}/findings", finding_markdown(f), global_step=step)
        done.findings = len(findings)
    finally:
        for w in writers.values():
            w.close()
    return done


def _write_point(writers: dict[str, Any], sf: StepFigures) -> int:
    n = 0
    for rank, figures in sf.ranks.items():
        w = writers[f"rank_{rank}"]
        for name, value in figures.items():
            w.add_scalar(f"{PREFIX}/{name}", value, global_step=sf.step, walltime=sf.wall_s)
            n += 1
    for name, value in sf.run.items():
        writers["run"].add_scalar(f"{PREFIX}/{name}", value, global_step=sf.step, walltime=sf.wall_s)
        n += 1
    return n
