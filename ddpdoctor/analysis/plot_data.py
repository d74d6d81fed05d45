"""The numbers behind the HTML report's plots, from a loaded run: pure data, no plotting library.

- step time per rank over the run (downsampled to a bounded number of points per rank);
- the step picked as "median" (median step time) and "worst" (the largest arrival lateness, the
  warm-up steps left out);
- the arrival heatmap (ranks x collectives, ms behind the earliest rank) at a step;
- one step's timeline per rank on aligned clocks (forward, buffer broadcast, backward, each
  bucket from ready to all-reduced, optimizer).

Where DDP runs over subgroups of the world, clocks are aligned and lateness measured within each
DDP group (``groups``): the heatmap shows every rank's lateness behind the earliest rank of its
own group, and the "worst" step is the one with the largest such lateness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from ddpdoctor.analysis.bucket_wait import StepArrivals
from ddpdoctor.analysis.clock_align import ClockOffsets
from ddpdoctor.analysis.compare import MIN_STEPS_AFTER_WARMUP, WARMUP_STEPS
from ddpdoctor.analysis.groups import ddp_groups, group_arrivals, merged_arrivals
from ddpdoctor.events import Step
from ddpdoctor.runlog import Run

#: Points per rank in the step-time plot: a 10,000-step run stays a small file.
MAX_POINTS = 1000
#: Up to this many ranks, one line each; above, the min/median/max across ranks plus the slowest ranks.
MAX_LINES = 32


@dataclass
class Series:
    """One line of the step-time plot."""

    name: str
    steps: list[int]
    ms: list[float]


@dataclass
class Segment:
    """One bar of a rank's step timeline (ms from the earliest rank's step start, aligned clocks)."""

    rank: int
    kind: str  # forward, buffer_sync, backward, bucket, optimizer
    label: str
    start_ms: float
    end_ms: float


@dataclass
class PlotData:
    """Everything the report's plots draw."""

    step_series: list[Series] = field(default_factory=list)
    aggregated: bool = False  # True: the series are min/median/max across ranks plus the slowest ranks
    median_step: int | None = None
    worst_step: int | None = None
    heatmaps: dict[str, tuple[int, list[str], list[int], list[list[float]]]] = field(default_factory=dict)
    timeline_step: int | None = None
    timeline: list[Segment] = field(default_factory=list)
    #: the ranks of each DDP group where DDP runs over subgroups of the world (empty: one group)
    ddp_groups: list[list[int]] = field(default_factory=list)


def _stride(n: int) -> int:
    return max(1, -(-n // MAX_POINTS))


def _step_series(run: Run) -> tuple[list[Series], bool]:
    per_rank = {
        r: [(s.step, s.end_us / 1000.0) for s in log.steps if s.end_us is not None]
        for r, log in sorted(run.ranks.items())
    }
    if len(per_rank) <= MAX_LINES:
        out = []
        for r, pts in per_rank.items():
            pts = pts[:: _stride(len(pts))]
            out.append(Series(f"rank {r}", [p[0] for p in pts], [round(p[1], 3) for p in pts]))
        return out, False
    by_step: dict[int, list[float]] = {}
    for pts in per_rank.values():
        for step, ms in pts:
            by_step.setdefault(step, []).append(ms)
    steps = sorted(by_step)[:: _stride(len(by_step))]
    out = [
        Series(name, steps, [round(fn(by_step[s]), 3) for s in steps])
        for name, fn in (("max over ranks", max), ("median over ranks", median), ("min over ranks", min))
    ]
    slowest = sorted(per_rank, key=lambda r: -(median([p[1] for p in per_rank[r]]) if per_rank[r] else 0.0))[:3]
    for r in slowest:
        pts = per_rank[r][:: _stride(len(per_rank[r]))]
        out.append(Series(f"rank {r} (slow)", [p[0] for p in pts], [round(p[1], 3) for p in pts]))
    return out, True


def _names(run: Run, step: int, n: int) -> list[str]:
    has_bcast = any(s.bcast_start_us is not None for log in run.ranks.values() for s in log.steps if s.step == step)
    return (["bcast"] if has_bcast else []) + [f"b{i}" for i in range(n - (1 if has_bcast else 0))]


def _heatmap(run: Run, sa: StepArrivals) -> tuple[int, list[str], list[int], list[list[float]]]:
    ranks = sorted(sa.lateness_us)
    n = max((len(v) for v in sa.lateness_us.values()), default=0)  # groups may train different models
    return sa.step, _names(run, sa.step, n), ranks, [[round(v / 1000.0, 3) for v in sa.lateness_us[r]] for r in ranks]


def _timeline(run: Run, step: int, clocks: ClockOffsets) -> list[Segment]:
    at: dict[int, Step] = {}
    for r, log in run.ranks.items():
        for s in log.steps:
            if s.step == step:
                at[r] = s
                break
    if not at:
        return []
    base = {r: s.t0_wall_ns / 1000.0 - clocks.offset_us.get(r, 0.0) for r, s in at.items()}
    zero = min(base.values())
    out: list[Segment] = []
    for r, s in sorted(at.items()):
        shift = base[r] - zero

        def seg(kind: str, label: str, a: float | None, b: float | None, rank: int = r, sh: float = shift) -> None:
            if a is not None and b is not None and b >= a:
                out.append(Segment(rank, kind, label, round((sh + a) / 1000.0, 3), round((sh + b) / 1000.0, 3)))

        fwd_start = s.fwd_start_us
        if s.bcast_start_us is not None and s.bcast_us is not None:
            seg("buffer_sync", "buffer broadcast", s.bcast_start_us, s.bcast_start_us + s.bcast_us)
        seg("forward", "forward", fwd_start, s.fwd_end_us)
        seg("backward", "backward", s.fwd_end_us, s.bwd_end_us)
        for i, ready in enumerate(s.b_ready_us):
            done = s.b_done_us[i] if i < len(s.b_done_us) else None
            seg("bucket", f"b{i}", ready, done)
        seg("optimizer", "optimizer", s.opt_start_us, s.opt_end_us)
    return out


def plot_data(run: Run) -> PlotData:
    """The report's plot data for ``run`` (as loaded by ``load_run``)."""
    data = PlotData()
    data.step_series, data.aggregated = _step_series(run)
    steps_by_rank = {r: log.steps for r, log in run.ranks.items()}
    groups = ddp_groups({r: log.header for r, log in run.ranks.items()})
    if len(groups) > 1:
        data.ddp_groups = groups
    clocks, by_group = group_arrivals(steps_by_rank, groups)
    # every group's arrivals at a step in one (each rank's lateness within its own group); with
    # several groups, the steps every group has
    per_step: dict[int, list[StepArrivals]] = {}
    for group_arrived in by_group:
        for sa in group_arrived:
            per_step.setdefault(sa.step, []).append(sa)
    compared = sum(1 for group_arrived in by_group if group_arrived)  # a one-rank group has no arrivals
    arrived = {
        k: merged for k, at in per_step.items() if len(at) == compared and (merged := merged_arrivals(at)) is not None
    }
    detailed = {k: sa for k, sa in arrived.items() if sa.per_bucket}
    if detailed:  # a compact log: the plots show steps every rank logged bucket by bucket
        arrived = detailed
    # the steps to pick from: those with arrivals from every rank when there are any, without
    # the first ones (DDP's first iteration and warm-up are slow or late for reasons of their own)
    times: dict[int, float] = {}
    for log in run.ranks.values():
        for s in log.steps:
            if s.end_us is not None and (not arrived or s.step in arrived):
                times[s.step] = max(times.get(s.step, 0.0), s.end_us)
    candidates = sorted(times)
    if len(candidates) - WARMUP_STEPS >= MIN_STEPS_AFTER_WARMUP:
        candidates = candidates[WARMUP_STEPS:]
    if candidates:
        ordered = sorted(candidates, key=lambda k: (times[k], k))
        data.median_step = ordered[len(ordered) // 2]
    if arrived and candidates:
        data.worst_step = max(candidates, key=lambda k: max(max(v) for v in arrived[k].lateness_us.values()))
        data.heatmaps["median"] = _heatmap(run, arrived[data.median_step])  # type: ignore[index]
        data.heatmaps["worst"] = _heatmap(run, arrived[data.worst_step])
    data.timeline_step = data.median_step
    if data.median_step is not None:
        data.timeline = _timeline(run, data.median_step, clocks)
    return data
