"""straggler and exposed-communication: cross-rank timing findings.

A straggler is found from bucket *arrival* skew on aligned clocks, not from step totals: a fast
rank blocks in the all-reduce until the slowest arrives, so totals even out. Where the straggler
loses its time is found from its own compute durations per phase, which exclude waiting:
before forward (data loading: the gap after the previous all-reduce, optimizer excluded),
forward (buffer broadcast excluded), backward (end of forward to end of backward compute), and
optimizer.
"""

from __future__ import annotations

from statistics import median

from ddpdoctor.analysis.bucket_wait import StepArrivals
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.events import Step

#: A rank is a straggler when its median lateness (at the collective it is latest for) is this many ms ...
MIN_LATENESS_MS = 10.0
#: ... and this share of the median step, and it is the latest rank in this share of the steps.
MIN_LATENESS_SHARE = 0.10
MIN_LATEST_SHARE = 0.6
#: Stragglers of part of a run (``straggler_periods``): windows of a tenth of the run, at least
#: this many steps each (fewer steps make one noisy step count too much).
PERIOD_WINDOWS = 10
PERIOD_MIN_STEPS = 20
#: Exposed communication worth an info, and a warning: a share of the step and an absolute floor
#: (the last bucket's all-reduce can only start when backward ends: about a millisecond of exposed
#: communication is the latency floor of any DDP step, not something to fix).
EXPOSED_INFO_SHARE = 0.10
EXPOSED_INFO_MS = 1.0
EXPOSED_WARNING_SHARE = 0.30
EXPOSED_WARNING_MS = 5.0

PHASE_FIX = {
    "data loading (before forward)": (
        "This rank starts its forward late: its input pipeline is slower. Give its DataLoader more "
        "workers or prefetching (num_workers=..., pin_memory=True, persistent_workers=True), check that "
        "its data shard is not larger or on slower storage than the others'."),
    "forward": ("This rank's forward is slower: check for rank-dependent work in forward (logging, "
                "metrics, extra branches) or a slower device/host."),
    "backward": ("This rank's backward is slower: check for rank-dependent hooks or a slower device/host "
                 "(thermal throttling, another process sharing it)."),
    "optimizer": ("This rank's optimizer step is slower: check for rank-dependent work after backward "
                  "(checkpointing, logging, EMA updates on one rank only)."),
}


def _phase_durations(s: Step, previous: Step | None) -> dict[str, float]:
    out: dict[str, float] = {}
    if s.fwd_us is not None:
        out["forward"] = s.fwd_us
    if s.bwd_end_us is not None and s.fwd_end_us is not None:
        out["backward"] = s.bwd_end_us - s.fwd_end_us
    if s.opt_start_us is not None and s.opt_end_us is not None:
        out["optimizer"] = s.opt_end_us - s.opt_start_us
    if previous is not None and previous.sync_end_us is not None and previous.end_us is not None:
        gap = previous.end_us - previous.sync_end_us
        if previous.opt_start_us is not None and previous.opt_end_us is not None:
            gap -= previous.opt_end_us - previous.opt_start_us
        out["data loading (before forward)"] = gap + s.fwd_start_us
    return out


def _median_phases(steps: list[Step]) -> dict[str, float]:
    columns: dict[str, list[float]] = {}
    previous = None
    for s in steps:
        for name, value in _phase_durations(s, previous if previous and previous.step == s.step - 1 else None).items():
            columns.setdefault(name, []).append(value)
        previous = s
    return {name: median(values) for name, values in columns.items() if values}


def _lateness(steps_by_rank: dict[int, list[Step]], arrivals: list[StepArrivals]) -> tuple[dict[int, list[float]], dict[int, int]]:
    """Per rank: its lateness (ms) at the collective it is latest for, per step; steps it was latest in."""
    lateness: dict[int, list[float]] = {r: [] for r in steps_by_rank}
    latest: dict[int, int] = {r: 0 for r in steps_by_rank}
    for sa in arrivals:
        for r, lat in sa.lateness_us.items():
            lateness.setdefault(r, []).append(max(lat) / 1000.0)  # at the collective it is latest for
        slowest = _latest(sa)
        latest[slowest] = latest.get(slowest, 0) + 1
    return lateness, latest


def _step_ms(steps_by_rank: dict[int, list[Step]]) -> float | None:
    ends = [s.end_us / 1000.0 for steps in steps_by_rank.values() for s in steps if s.end_us is not None]
    return median(ends) if ends else None


def _is_late(late_ms: float, latest_in: int, steps: int, step_ms: float) -> bool:
    return late_ms >= max(MIN_LATENESS_MS, MIN_LATENESS_SHARE * step_ms) and latest_in >= MIN_LATEST_SHARE * steps


def _late_ranks(steps_by_rank: dict[int, list[Step]], arrivals: list[StepArrivals]) -> set[int]:
    """The ranks that pass the straggler thresholds over ``arrivals``."""
    step_ms = _step_ms(steps_by_rank)
    if step_ms is None or len(arrivals) < 3:
        return set()
    lateness, latest = _lateness(steps_by_rank, arrivals)
    return {r for r, values in lateness.items()
            if values and _is_late(median(values), latest.get(r, 0), len(arrivals), step_ms)}


def stragglers(steps_by_rank: dict[int, list[Step]], arrivals: list[StepArrivals]) -> list[Finding]:
    """Ranks that arrive late at the buckets, where they lose the time, and what it costs the others."""
    if len(steps_by_rank) < 2 or len(arrivals) < 3:
        return []
    return [_finding(rank, steps_by_rank, arrivals) for rank in sorted(_late_ranks(steps_by_rank, arrivals))]


def straggler_periods(steps_by_rank: dict[int, list[Step]], arrivals: list[StepArrivals],
                      named: set[int]) -> list[Finding]:
    """Stragglers of part of a run only (a rank that turned slow late, or for a while).

    The whole-run test wants a rank latest in most steps, so a rank slow in the last 20% of a long
    run is not named by it. Here the run is cut into windows (a tenth of it, at least
    ``PERIOD_MIN_STEPS`` steps); the same thresholds are applied in each, and the windows in a row
    where a rank passes make one period, reported with its first and last step. Ranks in
    ``named`` (straggling over the whole run) are left out.
    """
    if len(steps_by_rank) < 2 or len(arrivals) < 2 * PERIOD_MIN_STEPS:
        return []
    size = max(PERIOD_MIN_STEPS, len(arrivals) // PERIOD_WINDOWS)
    bounds = [(i, min(i + size, len(arrivals))) for i in range(0, len(arrivals), size)]
    if bounds[-1][1] - bounds[-1][0] < PERIOD_MIN_STEPS // 2:  # a short tail joins the window before it
        bounds[-2:] = [(bounds[-2][0], bounds[-1][1])]
    out = []
    open_periods: dict[int, tuple[int, int]] = {}  # rank -> its period so far, as arrival indices
    for lo, hi in [*bounds, (len(arrivals), len(arrivals))]:  # the empty window closes every period
        window = arrivals[lo:hi]
        late = _late_ranks(_steps_between(steps_by_rank, window), window) - named if window else set()
        for rank in [r for r in open_periods if r not in late]:  # its period ended with the window before
            start, stop = _trim(rank, arrivals, *open_periods.pop(rank), size)
            if stop - start < len(arrivals):  # the whole run is the whole-run test's
                period = arrivals[start:stop]
                out.append(_finding(rank, _steps_between(steps_by_rank, period), period,
                                    period=(period[0].step, period[-1].step)))
        for rank in late:
            open_periods[rank] = (open_periods.get(rank, (lo, hi))[0], hi)
    return sorted(out, key=lambda f: (f.step or 0, f.ranks))


def _trim(rank: int, arrivals: list[StepArrivals], start: int, stop: int, margin: int) -> tuple[int, int]:
    """The period ``arrivals[start:stop]`` moved to the steps where ``rank`` really was late.

    Windows are coarse: a rank slow from step 200 passes the window 210-239 but not 180-209. The
    period becomes the first to the last step, within a window's ``margin`` around it, where the
    rank was the latest by at least half its median lateness in the period.
    """
    late_ms = median(max(sa.lateness_us[rank]) / 1000.0 for sa in arrivals[start:stop])
    lo, hi = max(0, start - margin), min(len(arrivals), stop + margin)
    hits = [i for i in range(lo, hi)
            if _latest(arrivals[i]) == rank and max(arrivals[i].lateness_us[rank]) / 1000.0 >= late_ms / 2]
    return (hits[0], hits[-1] + 1) if hits else (start, stop)


def _latest(sa: StepArrivals) -> int:
    """The rank latest at this step (at the collective it is latest for)."""
    return max(sa.lateness_us, key=lambda r: max(sa.lateness_us[r]))


def _steps_between(steps_by_rank: dict[int, list[Step]], arrivals: list[StepArrivals]) -> dict[int, list[Step]]:
    """Each rank's steps from the first to the last step of ``arrivals``."""
    lo, hi = arrivals[0].step, arrivals[-1].step
    return {r: [s for s in steps if lo <= s.step <= hi] for r, steps in steps_by_rank.items()}


def _finding(rank: int, steps_by_rank: dict[int, list[Step]], arrivals: list[StepArrivals],
             period: tuple[int, int] | None = None) -> Finding:
    """The straggler finding for ``rank`` over ``arrivals`` (of the steps ``period``, if only some)."""
    lateness, latest = _lateness(steps_by_rank, arrivals)
    step_ms = _step_ms(steps_by_rank) or 0.0
    late_ms = median(lateness[rank])
    phases = {r: _median_phases(steps) for r, steps in steps_by_rank.items()}
    others = [r for r in steps_by_rank if r != rank]
    excess = {
        name: value - median(phases[o][name] for o in others if name in phases[o])
        for name, value in phases[rank].items() if any(name in phases[o] for o in others)
    }
    phase = max(excess, key=excess.get) if excess else "unknown"  # type: ignore[arg-type]
    waited_ms = sum(sa.wait_us.get(o, 0.0) for sa in arrivals for o in others) / 1000.0
    first = next(sa.step for sa in arrivals if max(sa.lateness_us[rank]) / 1000.0 >= late_ms / 2)
    when = "" if period is None else f" in steps {period[0]} to {period[1]}"
    evidence = {"median_lateness_ms": late_ms, "latest_in_steps": latest[rank], "steps": len(arrivals),
                "phase": phase, "phase_excess_ms": {k: round(v / 1000.0, 3) for k, v in excess.items()},
                "others_waited_ms": waited_ms, "step_ms": step_ms}
    if period is not None:
        evidence["period"] = list(period)
    return Finding(
        code="straggler", severity="warning", ranks=[rank], step=first,
        title=f"rank {rank} arrives late at the step's collectives by {late_ms:.1f} ms{when}: {phase}",
        detail=(f"Rank {rank} reaches the step's collectives (buffer broadcast, gradient buckets) a median "
                f"{late_ms:.1f} ms after the earliest rank{when} "
                f"({late_ms / step_ms:.0%} of a {step_ms:.1f} ms step), latest in {latest[rank]} of "
                f"{len(arrivals)} steps{'' if period is None else ' of that period'}. Its {phase} takes "
                f"{excess.get(phase, 0.0) / 1000.0:.1f} ms longer than on the other ranks. The other ranks spent "
                f"{waited_ms / 1000.0:.1f} s in total waiting for it over {len(arrivals)} steps."),
        evidence=evidence,
        fix=PHASE_FIX.get(phase, "Look at what this rank does differently."),
    )


def exposed_communication(steps: list[Step], rank: int, floor_us: dict[int, float] | None = None) -> list[Finding]:
    """All-reduce time not hidden behind backward compute, on one rank.

    ``floor_us`` (step -> µs): the smallest exposed time any rank had at that step. The rank that
    finishes backward last waits for nobody, so its exposed time is communication alone; on the
    others it also holds the wait for that rank, which is a straggler's cost, not this one's.
    """
    exposed, comm, total = [], [], []
    for s in steps:
        if s.sync_end_us is None or s.bwd_end_us is None or s.end_us is None or not s.b_ready_us:
            continue
        ready = [t for t in s.b_ready_us if t is not None]
        mine = max(0.0, s.sync_end_us - s.bwd_end_us)
        exposed.append(min(mine, floor_us.get(s.step, mine)) if floor_us else mine)
        comm.append(s.sync_end_us - min(ready))
        total.append(s.end_us)
    if len(exposed) < 5:
        return []
    exposed_ms, comm_ms, step_ms = median(exposed) / 1000.0, median(comm) / 1000.0, median(total) / 1000.0
    share = exposed_ms / step_ms
    if share < EXPOSED_INFO_SHARE or exposed_ms < EXPOSED_INFO_MS:
        return []
    warn = share >= EXPOSED_WARNING_SHARE and exposed_ms >= EXPOSED_WARNING_MS
    overlap = 1.0 - exposed_ms / comm_ms if comm_ms > 0 else 0.0
    return [Finding(
        code="exposed-communication", severity="warning" if warn else "info",
        ranks=[rank], step=steps[0].step,
        title=f"{exposed_ms:.1f} ms of all-reduce per step not hidden behind backward ({share:.0%} of the step)",
        detail=(f"Backward compute ends {exposed_ms:.1f} ms (median) before the last bucket's all-reduce completes; "
                f"{overlap:.0%} of the {comm_ms:.1f} ms of communication overlaps with backward (waiting for slower "
                "ranks is not counted here: see straggler)."),
        evidence={"exposed_ms": exposed_ms, "allreduce_ms": comm_ms, "overlap_ratio": overlap, "share_of_step": share,
                  "steps": len(exposed)},
        fix=("Start communication earlier and make the last bucket small: a smaller bucket_cap_mb "
             "(DistributedDataParallel(net, bucket_cap_mb=...)) lets all-reduces start while backward runs; "
             "if ranks wait for a straggler, fix that first."),
    )]


def exposed_floor_us(steps_by_rank: dict[int, list[Step]]) -> dict[int, float]:
    """Per step, the smallest exposed communication time over the ranks that logged it."""
    out: dict[int, float] = {}
    for steps in steps_by_rank.values():
        for s in steps:
            if s.sync_end_us is not None and s.bwd_end_us is not None:
                value = max(0.0, s.sync_end_us - s.bwd_end_us)
                out[s.step] = min(out.get(s.step, value), value)
    return out
