"""Cross-rank arrival at the step's collectives (the buffer broadcast, when DDP does one, then each
bucket): how late each rank arrives, how long the others wait for it.

A fast rank blocks in a bucket's all-reduce until the slowest rank reaches the same bucket, so
per-rank durations even out; arrival times on aligned clocks do not.

A step that some rank logged as a window row (the compact log keeps each bucket's ready time at
sampled steps and around incidents only), or, on CUDA, between the sampled steps (where the
runtime marks the first and last bucket only), is compared at its first and last bucket on every
rank: a rank late at the first bucket, or still late at the last, is caught there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from ddpdoctor.analysis.clock_align import ClockOffsets
from ddpdoctor.events import Step


@dataclass
class StepArrivals:
    """One step across ranks: per rank, per bucket arrival lateness and the wait it caused."""

    step: int
    lateness_us: dict[int, list[float]] = field(default_factory=dict)  # behind the earliest rank, per collective
    wait_us: dict[int, float] = field(default_factory=dict)  # this rank blocked for others (max over buckets)
    bcast: bool = False  # the first collective is the buffer broadcast (at forward start), then the buckets
    per_bucket: bool = True  # one collective per bucket; False: the first and the last bucket (a window row)


def _first_last(times: list[float], bcast: bool) -> list[float]:
    head = times[:1] if bcast else []
    ready = times[1:] if bcast else times
    return head + [min(ready), max(ready)]


def arrivals(steps_by_rank: dict[int, list[Step]], clocks: ClockOffsets) -> list[StepArrivals]:
    """Every step that all ranks logged with complete bucket ready times (or their first and last)."""
    if len(steps_by_rank) < 2:
        return []
    by_step: dict[int, dict[int, list[float]]] = {}
    bcast_at: dict[int, dict[int, bool]] = {}
    summary_at: set[int] = set()
    for rank, steps in steps_by_rank.items():
        offset = clocks.offset_us.get(rank, 0.0)
        for s in steps:
            if s.summary:
                span = s.ready_span_us()
                if span is None:
                    continue
                ready, per_bucket = list(span), False
            else:  # the common case, inline: this loop runs over every step of every rank
                ready, per_bucket = cast(list[float], s.b_ready_us), True
                if not ready:
                    continue
                if None in ready:
                    # a bucket not seen (left out), or a CUDA step between the sampled ones,
                    # which marks its first and last bucket only (``runtime.step.recorder``):
                    # compared there, as a window row is
                    span = None if s.per_bucket() else s.ready_span_us()
                    if span is None or span[0] == span[1]:
                        continue
                    ready, per_bucket = list(span), False
            base = s.t0_wall_ns / 1000.0 - offset
            # the buffer broadcast at forward start is the step's first collective: a rank that
            # starts late is caught there, and the others wait inside it, before any bucket
            first = [s.bcast_start_us] if s.bcast_start_us is not None else []
            by_step.setdefault(s.step, {})[rank] = [base + t for t in first + ready]
            bcast_at.setdefault(s.step, {})[rank] = bool(first)
            if not per_bucket:
                summary_at.add(s.step)
    out = []
    ranks = set(steps_by_rank)
    for step in sorted(by_step):
        per_rank = by_step[step]
        if set(per_rank) != ranks:
            continue
        if step in summary_at:  # a window row on some rank: every rank at its first and last bucket
            per_rank = {r: _first_last(v, bcast_at[step][r]) for r, v in per_rank.items()}
        if len({len(v) for v in per_rank.values()}) != 1:
            continue
        n = len(next(iter(per_rank.values())))
        earliest = [min(per_rank[r][b] for r in per_rank) for b in range(n)]
        latest = [max(per_rank[r][b] for r in per_rank) for b in range(n)]
        sa = StepArrivals(step=step, bcast=all(bcast_at[step].values()), per_bucket=step not in summary_at)
        for r, times in per_rank.items():
            sa.lateness_us[r] = [t - e for t, e in zip(times, earliest, strict=False)]
            sa.wait_us[r] = max(lt - t for t, lt in zip(times, latest, strict=False))
        out.append(sa)
    return out
