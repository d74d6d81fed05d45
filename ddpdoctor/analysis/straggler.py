"""straggler and exposed-communication: cross-rank timing findings.

A straggler is found by blame (``blame.py``): the wall time the other ranks lost waiting for it
at the step's collectives, on aligned clocks, named when material however few steps it was late
in. Where the straggler lost its time is found from its own compute durations per phase in the
steps it was late, which exclude waiting, against the other ranks' at the same steps: between
steps (the gap after the previous step's all-reduce and optimizer: data loading, checkpointing,
evaluation), the previous step's optimizer, forward (buffer broadcast excluded) and backward (end
of forward to end of backward compute). A rank late at the buffer broadcast (forward's start) was
slow before its forward.
"""

from __future__ import annotations

from statistics import median

from ddpdoctor.analysis.blame import Blame, Pattern, RankBlame, blame, pattern
from ddpdoctor.analysis.bucket_wait import StepArrivals
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.events import Step

#: Exposed communication worth an info, and a warning: a share of the step and an absolute floor
#: (the last bucket's all-reduce can only start when backward ends: about a millisecond of exposed
#: communication is the latency floor of any DDP step, not something to fix).
EXPOSED_INFO_SHARE = 0.10
EXPOSED_INFO_MS = 1.0
EXPOSED_WARNING_SHARE = 0.30
EXPOSED_WARNING_MS = 5.0

#: The gap between steps: called data loading when the rank is slow there at every step (or for a
#: stretch of steps), "between steps" when only some steps are hit (a checkpoint, an evaluation).
#: The log cannot tell the DataLoader from other code between ``optimizer.step()`` and the next
#: forward; the pattern is the best witness of which it is.
DATA = "data loading (before forward)"
BETWEEN = "between steps"
GAP = "gap"
BEFORE_FORWARD = {GAP, "optimizer"}
#: Other ranks a straggler's phase durations are compared with (their median), at most.
PHASE_OTHERS = 32

PHASE_FIX = {
    DATA: (
        "This rank starts its forward late: its input pipeline is slower. Give its DataLoader more "
        "workers or prefetching (num_workers=..., pin_memory=True, persistent_workers=True), check that "
        "its data shard is not larger or on slower storage than the others'."
    ),
    "forward": (
        "This rank's forward is slower: check for rank-dependent work in forward (logging, "
        "metrics, extra branches) or a slower device/host."
    ),
    "backward": (
        "This rank's backward is slower: a slower device or host (thermal throttling, another process "
        "sharing it), or rank-specific work in backward (hooks, data-dependent work such as longer "
        "sequences on this rank)."
    ),
    "optimizer": (
        "This rank's optimizer step is slower: check for rank-dependent work after backward "
        "(checkpointing, logging, EMA updates on one rank only)."
    ),
}
BETWEEN_FIX = (
    "Something runs on this rank only between optimizer.step() and the next forward{when}, and every other rank "
    "waits for it in the next collective (the usual cause of DDP 'hangs' and NCCL timeouts). A checkpoint: "
    "save from every rank in parallel, or asynchronously, e.g.\n"
    "    import torch.distributed.checkpoint as dcp\n"
    "    future = dcp.async_save(model.state_dict(), checkpoint_id=path)  # on every rank\n"
    "An evaluation: run it on every rank (each on its shard), or in a separate process off the training "
    "ranks' critical path. Logging or metrics: make them cheap or asynchronous. If it is the input pipeline "
    "(a DataLoader whose workers fall behind every num_workers steps), add workers or prefetch_factor."
)


def _human_ms(ms: float) -> str:
    return f"{ms / 1000.0:.2f} s" if ms >= 1000.0 else f"{ms:.0f} ms"


def _phases(s: Step, previous: Step | None) -> dict[str, float]:
    """What delays this rank's arrival at step ``s``'s collectives, per phase (µs): the gap and the
    optimizer of the step before (since its last all-reduce), then this step's forward and backward."""
    out: dict[str, float] = {}
    if s.fwd_us is not None:
        out["forward"] = s.fwd_us
    if s.bwd_end_us is not None and s.fwd_end_us is not None:
        out["backward"] = s.bwd_end_us - s.fwd_end_us
    if previous is not None and previous.sync_end_us is not None and previous.end_us is not None:
        gap = previous.end_us - previous.sync_end_us
        if previous.opt_start_us is not None and previous.opt_end_us is not None:
            opt = previous.opt_end_us - previous.opt_start_us
            gap -= opt
            out["optimizer"] = opt
        out[GAP] = gap + s.fwd_start_us
    return out


def _phase_excess(
    rb: RankBlame, steps_by_rank: dict[int, list[Step]], bcast: dict[int, bool]
) -> dict[str, list[float]]:
    """Per phase, at each step ``rb.rank`` was late: its duration minus the other ranks' median (µs).

    The median is over at most ``PHASE_OTHERS`` other ranks, spread evenly over them: at 256 ranks
    the median of 32 is as good a reference, for an eighth of the cost (the live view runs this
    every other step)."""
    others = [r for r in sorted(steps_by_rank) if r != rb.rank]
    if len(others) > PHASE_OTHERS:
        stride = len(others) / PHASE_OTHERS
        others = [others[int(i * stride)] for i in range(PHASE_OTHERS)]
    index = {r: {s.step: s for s in steps_by_rank[r]} for r in (*others, rb.rank)}
    out: dict[str, list[float]] = {}
    for step, worst in zip(rb.late_steps, rb.worst, strict=True):
        phases = {}
        for r in index:
            s = index[r].get(step)
            if s is not None:
                phases[r] = _phases(s, index[r].get(step - 1))
        mine = phases.get(rb.rank, {})
        for name, value in mine.items():
            if bcast.get(step) and worst == 0 and name not in BEFORE_FORWARD:
                continue  # late at the broadcast, at forward's start: forward and backward came after
            theirs = [phases[o][name] for o in others if o in phases and name in phases[o]]
            if theirs:
                out.setdefault(name, []).append(value - median(theirs))
    return out


def _finding(rb: RankBlame, b: Blame, steps_by_rank: dict[int, list[Step]], bcast: dict[int, bool]) -> Finding:
    pat: Pattern = pattern(rb, b.steps)
    excess = _phase_excess(rb, steps_by_rank, bcast)
    total = {name: sum(v) for name, v in excess.items()}
    phase = max(total, key=total.get) if total else "unknown"  # type: ignore[arg-type]
    gap_label = DATA if pat.kind in ("every step", "one period") else BETWEEN
    label = gap_label if phase == GAP else phase
    named_excess = {(gap_label if k == GAP else k): round(median(v) / 1000.0, 3) for k, v in excess.items()}
    late_ms = median(rb.margins_ms)
    n, k = len(b.steps), len(rb.late_steps)
    when = {
        "every step": "",
        "periodic": f" every {pat.every} steps",
        "one period": f" in steps {pat.first} to {pat.last}",
        "intermittent": f" in {k} of {n} steps",
    }[pat.kind]
    share = rb.lost_ms / b.window_ms if b.window_ms else 0.0
    evidence = {
        "time_lost_ms": round(rb.lost_ms, 3),
        "share_of_time": round(share, 4),
        "pattern": pat.kind,
        "latest_in_steps": k,
        "steps": n,
        "first_step": pat.first,
        "last_step": pat.last,
        "late_steps": list(rb.late_steps[:50]),
        "median_lateness_ms": round(late_ms, 3),
        "phase": label,
        "phase_excess_ms": named_excess,
        "others_waited_ms": round(rb.others_waited_ms, 3),
        "step_ms": round(b.step_ms, 3),
        "noise_floor_ms": round(b.floor_ms, 3),
        "others_blamed_ms": round(rb.noise_ms, 3),
    }
    if pat.kind == "periodic":
        evidence["every_n_steps"] = pat.every
    if pat.kind == "one period":
        evidence["period"] = [pat.first, pat.last]
    phase_ms = named_excess.get(label, 0.0)
    if label == BETWEEN:
        fix = BETWEEN_FIX.format(when=f" every {pat.every} steps" if pat.every else " on some steps")
    else:
        fix = PHASE_FIX.get(label, "Look at what this rank does differently.")
    return Finding(
        code="straggler",
        severity="warning",
        ranks=[rb.rank],
        step=pat.first,
        title=(
            # (no brackets around the time lost: a phase may end in its own, "data loading (before forward)")
            f"rank {rb.rank} arrives late at the step's collectives by {late_ms:.1f} ms{when}: {label}, "
            f"{_human_ms(rb.lost_ms)} lost"
        ),
        detail=(
            f"The other ranks lost {_human_ms(rb.lost_ms)} waiting for rank {rb.rank} ({share:.0%} of the "
            f"{_human_ms(b.window_ms)} the {n} steps took), late {pat.describe(k, n)} by a median "
            f"{late_ms:.1f} ms over the next latest rank (a {b.step_ms:.1f} ms step). In those steps "
            f"{'the time between its steps' if label == BETWEEN else 'its ' + label} was {phase_ms:.1f} ms longer "
            "than on the other ranks (median). Margins under "
            f"{b.floor_ms:.1f} ms are jitter and not counted; the other ranks were blamed for "
            f"{_human_ms(rb.noise_ms)} of jitter."
        ),
        evidence=evidence,
        fix=fix,
    )


def stragglers(
    steps_by_rank: dict[int, list[Step]], arrivals: list[StepArrivals], b: Blame | None = None
) -> list[Finding]:
    """Ranks whose lateness at the collectives cost the others material time over ``arrivals``
    (the whole run, or a live window), with the pattern, the phase and the fix.

    ``b``: the blame over exactly these ``arrivals`` when the caller already has it (the live view
    also shows every rank's time lost from it); computed here otherwise."""
    if len(steps_by_rank) < 2 or len(arrivals) < 3:
        return []
    if b is None:
        b = blame(steps_by_rank, arrivals)
    bcast = {sa.step: sa.bcast for sa in arrivals}
    return [_finding(rb, b, steps_by_rank, bcast) for rb in b.named()]


def exposed_communication(steps: list[Step], rank: int, floor_us: dict[int, float] | None = None) -> list[Finding]:
    """All-reduce time not hidden behind backward compute, on one rank.

    ``floor_us`` (step -> µs): the smallest exposed time any rank had at that step. The rank that
    finishes backward last waits for nobody, so its exposed time is communication alone; on the
    others it also holds the wait for that rank, which is a straggler's cost, not this one's.
    """
    exposed, comm, total = [], [], []
    for s in steps:
        span = s.ready_span_us()
        if s.sync_end_us is None or s.bwd_end_us is None or s.end_us is None or span is None:
            continue
        mine = max(0.0, s.sync_end_us - s.bwd_end_us)
        exposed.append(min(mine, floor_us.get(s.step, mine)) if floor_us else mine)
        comm.append(s.sync_end_us - span[0])
        total.append(s.end_us)
    if len(exposed) < 5:
        return []
    exposed_ms, comm_ms, step_ms = median(exposed) / 1000.0, median(comm) / 1000.0, median(total) / 1000.0
    share = exposed_ms / step_ms
    if share < EXPOSED_INFO_SHARE or exposed_ms < EXPOSED_INFO_MS:
        return []
    warn = share >= EXPOSED_WARNING_SHARE and exposed_ms >= EXPOSED_WARNING_MS
    overlap = 1.0 - exposed_ms / comm_ms if comm_ms > 0 else 0.0
    return [
        Finding(
            code="exposed-communication",
            severity="warning" if warn else "info",
            ranks=[rank],
            step=steps[0].step,
            title=f"{exposed_ms:.1f} ms of all-reduce per step not hidden behind backward ({share:.0%} of the step)",
            detail=(
                f"Backward compute ends {exposed_ms:.1f} ms (median) before the last bucket's all-reduce completes; "
                f"{overlap:.0%} of the {comm_ms:.1f} ms of communication overlaps with backward (waiting for slower "
                "ranks is not counted here: see straggler)."
            ),
            evidence={
                "exposed_ms": exposed_ms,
                "allreduce_ms": comm_ms,
                "overlap_ratio": overlap,
                "share_of_step": share,
                "step_ms": step_ms,
                "steps": len(exposed),
            },
            fix=(
                "Start communication earlier and make the last bucket small: a smaller bucket_cap_mb "
                "(DistributedDataParallel(net, bucket_cap_mb=...)) lets all-reduces start while backward runs; "
                "if ranks wait for a straggler, fix that first."
            ),
        )
    ]


def exposed_floor_us(steps_by_rank: dict[int, list[Step]]) -> dict[int, float]:
    """Per step, the smallest exposed communication time over the ranks that logged it."""
    out: dict[int, float] = {}
    for steps in steps_by_rank.values():
        for s in steps:
            if s.sync_end_us is not None and s.bwd_end_us is not None:
                value = max(0.0, s.sync_end_us - s.bwd_end_us)
                out[s.step] = min(out.get(s.step, value), value)
    return out
