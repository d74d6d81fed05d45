"""Estimating each rank's clock offset from the log alone (no clock is assumed correct).

All ranks leave a bucket's all-reduce at nearly the same instant: the collective completes
when the last rank's data has arrived, and every rank learns it within a network hop. So the
difference between a rank's and the reference rank's completion times, on their own wall
clocks, estimates the offset between those clocks to within that hop.

A completion mark is taken when the rank's thread gets to it, so it can only be late: a rank
whose cores are busy (often the straggler itself) stamps some buckets a millisecond or more after
the others. Two choices make the estimate hold then:

- a *mode* of the differences, not their median (``densest_median``): the lag-free pairs
  agree to within the hop, the late ones spread out; with two buckets, one of them late on
  every step, the median falls anywhere between the two;
- per-bucket pairs (full records) where there are ``MIN_FULL_STEPS`` of them: a window row
  keeps only its step's last completion, which is a late bucket's whenever one is late, so
  window rows serve only a log that has too few full records (the compact log keeps its
  sampled steps in full).

Without bucket data (a one-rank run, timing off) the wall clocks are trusted as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import cast

from ddpdoctor.events import Step

#: Steps sampled for the estimate (the mode is stable long before this).
MAX_STEPS = 512
#: Steps with every bucket's completion on both ranks enough to estimate from them alone.
MIN_FULL_STEPS = 8
#: The share of the differences whose tightest interval gives the offset (``densest_median``): a
#: quarter, so lag-free pairs still decide where a late bucket is half of them or more.
DENSEST_SHARE = 0.25
#: ... and at least this many of them (the live view estimates from its last few steps).
MIN_DENSEST = 8


@dataclass
class ClockOffsets:
    """Per-rank offset (µs) to subtract from a rank's wall time to put it on the reference clock."""

    reference: int
    offset_us: dict[int, float]
    method: dict[int, str]  # "collective" or "wall"

    def aligned_us(self, rank: int, wall_ns: int, rel_us: float) -> float:
        return wall_ns / 1000.0 + rel_us - self.offset_us.get(rank, 0.0)


def _done_times(steps: list[Step]) -> dict[int, tuple[list[float], bool]]:
    """Per step, every bucket's completion on the rank's wall clock, and True; a window row has
    the last one only (False)."""
    out: dict[int, tuple[list[float], bool]] = {}
    for s in steps[-MAX_STEPS:]:
        base = s.t0_wall_ns / 1000.0
        if s.b_done_us and all(t is not None for t in s.b_done_us):
            out[s.step] = ([base + t for t in cast(list[float], s.b_done_us)], True)  # None ruled out just above
        elif s.sync_end_us is not None and s.bucket_count() and not s.per_bucket():
            # a window row, or a CUDA step between the sampled ones (no per-bucket done marks)
            out[s.step] = ([base + s.sync_end_us], False)
    return out


def densest_median(values: list[float], share: float = DENSEST_SHARE) -> float:
    """A mode of ``values`` (not empty): the median of the shortest interval that holds ``share``
    of them. Unlike the median of all it stays on the tight cluster when many values spread out
    to one side: with half of them late and spread, and half tight, it is the tight half's."""
    x = sorted(values)
    # (at least MIN_DENSEST values: of a few steps' differences, a quarter would be two or three
    # values and follow the hop's jitter)
    k = min(len(x), max(MIN_DENSEST, math.ceil(share * len(x))))
    # (the i-th interval of k values is x[i] .. x[i + k - 1]; the shorter list ends the pairs)
    widths = [b - a for a, b in zip(x, x[k - 1 :], strict=False)]
    start = widths.index(min(widths))
    return median(x[start : start + k])


def _deltas(mine: dict[int, tuple[list[float], bool]], ref: dict[int, tuple[list[float], bool]]) -> list[float]:
    """Completion differences of the steps both ranks logged: bucket by bucket where both have
    every bucket's, and only those where there are enough of them (module docstring)."""
    common = [step for step in mine if step in ref]
    full = [step for step in common if mine[step][1] and ref[step][1] and len(mine[step][0]) == len(ref[step][0])]
    if len(full) >= MIN_FULL_STEPS:
        return [a - b for step in full for a, b in zip(mine[step][0], ref[step][0], strict=True)]
    out: list[float] = []
    for step in common:
        times, theirs = mine[step][0], ref[step][0]
        if len(times) == len(theirs):
            out.extend(a - b for a, b in zip(times, theirs, strict=True))
        else:  # a full record on one side, a window row on the other: compare the last completion
            out.append(max(times) - max(theirs))
    return out


def estimate_offsets(steps_by_rank: dict[int, list[Step]]) -> ClockOffsets:
    """Offsets of every rank against the lowest rank."""
    if not steps_by_rank:
        return ClockOffsets(reference=0, offset_us={}, method={})
    reference = min(steps_by_rank)
    ref = _done_times(steps_by_rank[reference])
    offsets: dict[int, float] = {reference: 0.0}
    method: dict[int, str] = {reference: "collective" if ref else "wall"}
    for rank, steps in steps_by_rank.items():
        if rank == reference:
            continue
        deltas = _deltas(_done_times(steps), ref)
        if deltas:
            offsets[rank] = densest_median(deltas)
            method[rank] = "collective"
        else:
            offsets[rank] = 0.0
            method[rank] = "wall"
    return ClockOffsets(reference=reference, offset_us=offsets, method=method)
