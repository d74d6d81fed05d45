"""A per-run communication cost model fitted from the measured bucket all-reduces.

One all-reduce of ``n`` bytes is modelled as ``latency + n / bandwidth``. Each measured bucket
gives one sample: from the moment it could start (launched, and the previous bucket's
all-reduce done: a process group runs them one after another) to its completion. A rank that
arrived early also waits for the late ranks inside that interval, so for each step and bucket
the smallest duration over the ranks is used: the rank that arrived last waited for nobody.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import cast

from ddpdoctor.events import Step


@dataclass(frozen=True)
class CommModel:
    """``predict_us(n) = latency_us + n * us_per_byte``, and how well that fits the samples."""

    latency_us: float
    us_per_byte: float
    samples: int
    sizes: int  # distinct bucket sizes seen: with one, the split between latency and bandwidth is a guess
    r2: float  # share of the duration variance the line explains (1.0 when there is one size)
    median_abs_error_pct: float  # typical misfit of one sample

    def predict_us(self, nbytes: float) -> float:
        return self.latency_us + nbytes * self.us_per_byte

    @property
    def bandwidth_gbps(self) -> float:
        """Effective all-reduce bandwidth, GB/s (bytes of the bucket over its transfer time)."""
        return 1e-3 / self.us_per_byte if self.us_per_byte > 0 else float("inf")


def bucket_durations(steps: list[Step]) -> dict[tuple[int, int], tuple[int, float]]:
    """(step, bucket) -> (bytes, µs the all-reduce took once it could start), for one rank."""
    out: dict[tuple[int, int], tuple[int, float]] = {}
    for s in steps:
        n = len(s.b_done_us)
        if not n or len(s.b_launch_us) != n or len(s.b_bytes) != n or None in s.b_done_us or None in s.b_launch_us:
            continue
        launch, done = cast(list[float], s.b_launch_us), cast(list[float], s.b_done_us)  # None ruled out above
        previous_done = 0.0
        for b in sorted(range(n), key=launch.__getitem__):
            start = max(launch[b], previous_done)
            out[(s.step, b)] = (s.b_bytes[b], max(0.0, done[b] - start))
            previous_done = max(previous_done, done[b])
    return out


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float, float, int] | None:
    """(intercept, slope, r2, distinct x) of a least-squares line through (bytes, µs) points.

    One point per distinct size (its median), so a size seen in every step does not outweigh the
    rest. With a single size the split between intercept and slope is not determined: a tenth
    of the time is taken as the fixed part. A line that noise made negative keeps its
    non-negative part.
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
    if slope <= 0 or intercept < 0:
        slope, intercept = max(slope, 0.0), max(0.0, min(ys))
    syy = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True)) / syy if syy > 0 else 1.0
    return intercept, slope, r2, len(xs)


def fit_comm_model(steps_by_rank: dict[int, list[Step]], skip_steps: int = 2) -> CommModel | None:
    """The cost model of the run's all-reduces (None with fewer than 3 measured buckets).

    The first ``skip_steps`` steps are left out: DDP rebuilds its buckets after the first, and the
    first all-reduces pay for connection set-up.
    """
    best: dict[tuple[int, int], tuple[int, float]] = {}
    for steps in steps_by_rank.values():
        for key, (nbytes, us) in bucket_durations([s for s in steps if s.step >= skip_steps]).items():
            if key not in best or us < best[key][1]:
                best[key] = (nbytes, us)
    line = fit_line(list(best.values())) if len(best) >= 3 else None
    if line is None:
        return None
    latency, slope, r2, sizes = line
    errors = [abs(latency + slope * n - us) / us for n, us in best.values() if us > 0]
    return CommModel(
        latency_us=latency,
        us_per_byte=slope,
        samples=len(best),
        sizes=sizes,
        r2=r2,
        median_abs_error_pct=100.0 * median(errors) if errors else 0.0,
    )
