"""Estimating each rank's clock offset from the log alone (no clock is assumed correct).

All ranks leave a bucket's all-reduce at nearly the same instant: the collective completes
when the last rank's data has arrived, and every rank learns it within a network hop. So the
median difference between a rank's and the reference rank's completion times, on their own
wall clocks, estimates the offset between those clocks to within that hop. Without bucket data
(a one-rank run, timing off) the wall clocks are trusted as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import cast

from ddpdoctor.events import Step

#: Steps sampled for the estimate (the median is stable long before this).
MAX_STEPS = 512


@dataclass
class ClockOffsets:
    """Per-rank offset (µs) to subtract from a rank's wall time to put it on the reference clock."""

    reference: int
    offset_us: dict[int, float]
    method: dict[int, str]  # "collective" or "wall"

    def aligned_us(self, rank: int, wall_ns: int, rel_us: float) -> float:
        return wall_ns / 1000.0 + rel_us - self.offset_us.get(rank, 0.0)


def _done_times(steps: list[Step]) -> dict[int, list[float]]:
    """Per step, every bucket's completion on the rank's wall clock; a window row has the last one only."""
    out: dict[int, list[float]] = {}
    for s in steps[-MAX_STEPS:]:
        base = s.t0_wall_ns / 1000.0
        if s.b_done_us and all(t is not None for t in s.b_done_us):
            out[s.step] = [base + t for t in cast(list[float], s.b_done_us)]  # None ruled out just above
        elif s.sync_end_us is not None and s.bucket_count() and not s.per_bucket():
            # a window row, or a CUDA step between the sampled ones (no per-bucket done marks)
            out[s.step] = [base + s.sync_end_us]
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
        mine = _done_times(steps)
        deltas = [
            a - b
            for step, times in mine.items()
            if step in ref
            # a full record on one side, a window row on the other: compare the last completion
            for a, b in (
                zip(times, ref[step], strict=True) if len(ref[step]) == len(times) else [(max(times), max(ref[step]))]
            )
        ]
        if deltas:
            offsets[rank] = median(deltas)
            method[rank] = "collective"
        else:
            offsets[rank] = 0.0
            method[rank] = "wall"
    return ClockOffsets(reference=reference, offset_us=offsets, method=method)
