"""ddpdoctor's per-step figures as the dashboards get them: one number per name, per rank and per run.

The figures are read off what the analysis already computes: a step's phases from
``analysis.phases.step_phases``, a rank's lateness and wait at the step's collectives from the
cross-rank arrivals of ``analysis.groups`` (clocks aligned within each DDP group, as the report
and the live view align them), and the time a step lost to its latest rank from
``analysis.blame.step_margins``. ``ddpdoctor export`` (a whole run) and the trainer callbacks (a
run being written) both call ``step_figures``, so a figure means the same wherever it shows.

Per rank (``RANK_FIGURES``): step time, forward, backward, buffer broadcast, all-reduce wait
(blocked in the step's collectives for slower ranks), exposed communication (not hidden behind
backward compute) and lateness (behind the earliest rank of its group at the collective it was
latest for). Per run (``RUN_FIGURES``): the slowest rank's step, and the time lost to stragglers
(how much sooner the step's collectives would have completed had each one's latest rank arrived
with the runner-up: the margins blame is built from, summed over the DDP groups).

A long run is summarized in blocks of steps (``blocks``): durations by their mean, lateness and
the slowest step by their maximum (one late step in a block still shows), time lost by its sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import fmean

from ddpdoctor.analysis.blame import step_margins
from ddpdoctor.analysis.bucket_wait import StepArrivals
from ddpdoctor.analysis.groups import ddp_groups, group_arrivals
from ddpdoctor.analysis.phases import step_phases
from ddpdoctor.events import Header, Step

#: Per-rank figures, with what each one is (the docs page and the export's summary list them).
RANK_FIGURES: dict[str, str] = {
    "step_ms": "whole step, first forward to the next step's first forward",
    "forward_ms": "forward compute, buffer broadcast excluded",
    "backward_ms": "end of forward to end of backward compute",
    "buffer_broadcast_ms": "broadcast of module buffers from rank 0 inside forward",
    "allreduce_wait_ms": "blocked in the step's collectives for slower ranks",
    "exposed_comm_ms": "communication not hidden behind backward compute",
    "lateness_ms": "behind the earliest rank of its DDP group at the collective it was latest for",
}
#: Per-run figures.
RUN_FIGURES: dict[str, str] = {
    "slowest_step_ms": "the slowest rank's step",
    "lost_to_stragglers_ms": "how much sooner the step's collectives would have completed had their latest rank "
    "arrived with the runner-up",
}
#: How a block of steps is summed up into one point (``blocks``); the others take the mean.
_BLOCK_MAX = frozenset({"lateness_ms", "slowest_step_ms"})
_BLOCK_SUM = frozenset({"lost_to_stragglers_ms"})

Figures = dict[str, float]


@dataclass
class StepFigures:
    """One step's figures: per rank (only the figures its log tells), and for the run."""

    step: int
    wall_s: float  # when the step began (the earliest rank's wall clock), for the dashboards' time axis
    ranks: dict[int, Figures] = field(default_factory=dict)
    run: Figures = field(default_factory=dict)


def rank_figures(s: Step, late_ms: float | None, wait_ms: float | None) -> Figures:
    """One rank's figures at one step: its phases, and its lateness and wait at the step's
    collectives (None where the arrivals of every rank were not there); unknown figures left out."""
    phases = step_phases(s)
    values = {
        "step_ms": phases["step"],
        "forward_ms": phases["forward"],
        "backward_ms": phases["backward"],
        "buffer_broadcast_ms": phases["buffer_sync"],
        "allreduce_wait_ms": wait_ms,
        "exposed_comm_ms": phases["exposed_comm"],
        "lateness_ms": late_ms,
    }
    return {k: round(v, 3) for k, v in values.items() if v is not None}


def step_figures(
    steps_by_rank: Mapping[int, Sequence[Step]],
    headers: Mapping[int, Header | None],
    only: Iterable[int] | None = None,
) -> list[StepFigures]:
    """The figures of every step in ``steps_by_rank`` (or of the steps ``only`` names), in step order.

    ``steps_by_rank`` may hold more steps than are wanted (earlier ones help align the clocks);
    ``headers`` give the DDP groups (``analysis.groups.ddp_groups``)."""
    by_rank = {r: list(steps) for r, steps in steps_by_rank.items()}
    wanted = set(only) if only is not None else None
    groups = ddp_groups({r: headers.get(r) for r in by_rank})
    _, by_group = group_arrivals(by_rank, groups)
    at: dict[int, list[StepArrivals]] = {}
    for arrived in by_group:
        for sa in arrived:
            if wanted is None or sa.step in wanted:
                at.setdefault(sa.step, []).append(sa)
    per_step: dict[int, StepFigures] = {}
    for rank, steps in by_rank.items():
        for s in steps:
            if wanted is not None and s.step not in wanted:
                continue
            out = per_step.get(s.step)
            if out is None:
                out = per_step[s.step] = StepFigures(s.step, s.t0_wall_ns / 1e9)
            out.wall_s = min(out.wall_s, s.t0_wall_ns / 1e9)
            late = wait = None
            for sa in at.get(s.step, ()):
                if rank in sa.lateness_us:
                    lateness = sa.lateness_us[rank]
                    late = max(lateness) / 1000.0 if lateness else None
                    wait = sa.wait_us.get(rank, 0.0) / 1000.0
            out.ranks[rank] = rank_figures(s, late, wait)
    for step, out in per_step.items():
        ends = [f["step_ms"] for f in out.ranks.values() if "step_ms" in f]
        if ends:
            out.run["slowest_step_ms"] = max(ends)
        met = at.get(step)
        if met:  # one number per DDP group: the largest margin of any of its ranks
            lost = sum(max((m[0] for m in step_margins(sa).values()), default=0.0) for sa in met)
            out.run["lost_to_stragglers_ms"] = round(lost, 3)
    return [per_step[k] for k in sorted(per_step)]


def _summed(name: str, values: list[float]) -> float:
    if name in _BLOCK_MAX:
        return max(values)
    if name in _BLOCK_SUM:
        return round(sum(values), 3)
    return round(fmean(values), 3)


def _merge(figures: Iterable[Figures]) -> Figures:
    collected: dict[str, list[float]] = {}
    for f in figures:
        for name, v in f.items():
            collected.setdefault(name, []).append(v)
    return {name: _summed(name, values) for name, values in collected.items()}


def blocks(steps: Sequence[StepFigures], size: int) -> list[StepFigures]:
    """``steps`` summed up in blocks of ``size`` step indices (0..size-1, size..2*size-1, ...): one
    point per block, at its last step, with the block's first wall time; ``size`` 1 returns them."""
    if size <= 1:
        return list(steps)
    grouped: dict[int, list[StepFigures]] = {}
    for sf in steps:
        grouped.setdefault(sf.step // size, []).append(sf)
    out = []
    for members in grouped.values():
        ranks = sorted({r for sf in members for r in sf.ranks})
        out.append(
            StepFigures(
                step=members[-1].step,
                wall_s=members[0].wall_s,
                ranks={r: _merge(sf.ranks[r] for sf in members if r in sf.ranks) for r in ranks},
                run=_merge(sf.run for sf in members),
            )
        )
    return out
