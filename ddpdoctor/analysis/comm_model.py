"""A per-run communication cost model fitted from the measured bucket all-reduces.

One all-reduce of ``n`` bytes is modelled as ``latency + n / bandwidth``. Each measured bucket
gives one sample: from the moment it could start to its completion. It could start once the last
rank launched it and the previous bucket's all-reduce was done; the ranks of a step are put on
one clock by their completions, which all ranks see at nearly the same moment. A rank that
arrived early waits for the late ones before that start, so the sample holds the transfer, not
the wait. (Gloo runs two collectives at once, on two threads, and completes them out of order at
times; on the runs of ``bench/bucket_whatif.py`` one at a time predicted the steps better, the
two threads sharing one link and the cores.)

With buckets of a single size the split between the fixed cost and the per-byte cost is not
measured (``CommModel.split_known``): the advice then bounds a saving by both extremes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import fmean, median
from typing import cast

from ddpdoctor.events import Step

#: How far apart the bucket sizes must be for the fit to tell the fixed cost from the per-byte cost.
SPLIT_SIZE_RATIO = 2.0


@dataclass(frozen=True)
class CommModel:
    """``predict_us(n) = latency_us + n * us_per_byte``, and how well that fits the samples."""

    latency_us: float
    us_per_byte: float
    samples: int
    sizes: int  # distinct bucket sizes seen: with one, the split between latency and bandwidth is a guess
    r2: float  # share of the duration variance the line explains (1.0 when there is one size)
    median_abs_error_pct: float  # typical misfit of the line at a size (against that size's time)
    typical_bytes: float = 0.0  # the median bucket size sampled
    size_ratio: float = 1.0  # the largest bucket size sampled over the smallest

    @property
    def split_known(self) -> bool:
        """Whether the samples' sizes differ enough (twice or more) to tell the fixed cost from the
        per-byte cost: sizes closer than that leave the split to a few noisy medians."""
        return self.size_ratio >= SPLIT_SIZE_RATIO

    def extremes(self) -> tuple[CommModel, CommModel]:
        """The two models a single size cannot tell apart: all of a typical bucket's time per
        byte, and all of it fixed."""
        typical = self.predict_us(self.typical_bytes)
        per_byte = typical / self.typical_bytes if self.typical_bytes > 0 else self.us_per_byte
        return replace(self, latency_us=0.0, us_per_byte=per_byte), replace(self, latency_us=typical, us_per_byte=0.0)

    def predict_us(self, nbytes: float) -> float:
        return self.latency_us + nbytes * self.us_per_byte

    @property
    def bandwidth_gbps(self) -> float:
        """Effective all-reduce bandwidth, GB/s (bytes of the bucket over its transfer time)."""
        return 1e-3 / self.us_per_byte if self.us_per_byte > 0 else float("inf")


def _complete(s: Step) -> bool:
    """Every bucket's launch and completion marked."""
    n = len(s.b_done_us)
    if not n or not len(s.b_launch_us) == n == len(s.b_bytes):
        return False
    return None not in s.b_done_us and None not in s.b_launch_us


def bucket_durations(steps_by_rank: dict[int, list[Step]]) -> dict[tuple[int, int], tuple[int, float]]:
    """(step, bucket) -> (bytes, µs the all-reduce took once it could start), over the ranks that
    logged the step with every bucket's marks."""
    by_step: dict[int, list[Step]] = {}
    for steps in steps_by_rank.values():
        for s in steps:
            if _complete(s):
                by_step.setdefault(s.step, []).append(s)
    out: dict[tuple[int, int], tuple[int, float]] = {}
    for step, ranks in by_step.items():
        n = len(ranks[0].b_done_us)
        if any(len(s.b_done_us) != n for s in ranks):
            continue
        done_by_rank = [cast(list[float], s.b_done_us) for s in ranks]  # None ruled out by _complete
        ref = done_by_rank[0]
        shifts = [median(d - e for d, e in zip(done, ref, strict=True)) for done in done_by_rank]
        pairs = list(zip(ranks, shifts, strict=True))
        launch = [max(cast(float, s.b_launch_us[b]) - sh for s, sh in pairs) for b in range(n)]
        done = [max(d[b] - sh for d, sh in zip(done_by_rank, shifts, strict=True)) for b in range(n)]
        previous_done = float("-inf")
        for b in sorted(range(n), key=launch.__getitem__):
            out[(step, b)] = (ranks[0].b_bytes[b], max(0.0, done[b] - max(launch[b], previous_done)))
            previous_done = max(previous_done, done[b])
    return out


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float, float, int] | None:
    """(intercept, slope, r2, distinct x) of a least-squares line through (bytes, µs) points.

    One point per distinct size (its median), so a size seen in every step does not outweigh the
    rest. With a single size the split between intercept and slope is not determined: a tenth of
    the time is taken as the fixed part. Times that do not grow with the size give a flat line at
    their median; a line that noise made start below zero goes through zero.
    """
    if not points:
        return None
    by_size: dict[int, list[float]] = {}
    for nbytes, us in points:
        by_size.setdefault(nbytes, []).append(us)
    xs = sorted(by_size)
    ys = [median(by_size[x]) for x in xs]
    if len(xs) == 1 or max(xs) - min(xs) < 0.05 * max(xs):
        fixed = 0.1 * median(ys)
        return fixed, (median(ys) - fixed) / max(1.0, median(xs)), 1.0, len(xs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if slope <= 0:
        slope, intercept = 0.0, median(ys)
    elif intercept < 0:
        slope, intercept = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs), 0.0
    syy = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True)) / syy if syy > 0 else 1.0
    return intercept, slope, r2, len(xs)


def fit_comm_model(steps_by_rank: dict[int, list[Step]], skip_steps: int = 2) -> CommModel | None:
    """The cost model of the run's all-reduces (None with fewer than 3 measured buckets).

    The first ``skip_steps`` steps are left out: DDP rebuilds its buckets after the first, and the
    first all-reduces pay for connection set-up.
    """
    later = {r: [s for s in steps if s.step >= skip_steps] for r, steps in steps_by_rank.items()}
    durations = bucket_durations(later)
    if len(durations) < 3:
        return None
    # per size, the mean time in each step, then the median over steps: on a loaded host most
    # all-reduces finish at once after the one before and a few wait milliseconds for a descheduled
    # thread, a risk each all-reduce runs (the median of single all-reduces, near zero, missed a
    # third of such a run's step); a step the whole process lost the cores in is one step of many
    in_step: dict[tuple[int, int], list[float]] = {}
    for (step, _), (nbytes, us) in durations.items():
        in_step.setdefault((nbytes, step), []).append(us)
    points = [(nbytes, fmean(times)) for (nbytes, _), times in in_step.items()]
    line = fit_line(points)
    if line is None:
        return None
    latency, slope, r2, sizes = line
    by_size: dict[int, list[float]] = {}
    for nbytes, us in points:
        by_size.setdefault(nbytes, []).append(us)
    centers = {nbytes: median(times) for nbytes, times in by_size.items()}
    errors = [abs(latency + slope * n - c) / c for n, c in centers.items() if c > 0]
    samples = list(durations.values())
    return CommModel(
        latency_us=latency,
        us_per_byte=slope,
        samples=len(samples),
        sizes=sizes,
        r2=r2,
        median_abs_error_pct=100.0 * median(errors) if errors else 0.0,
        typical_bytes=median(n for n, _ in samples),
        size_ratio=max(n for n, _ in samples) / max(1, min(n for n, _ in samples)),
    )
