"""bucket-size: a better ``bucket_cap_mb``, predicted from the run's own measurements.

The simulator (``bucket_sim``) predicts the step time for the run's configuration and for each
candidate cap. Gains are judged prediction against prediction (the model's own bias cancels);
the prediction for the run's own configuration against its measured step time says how far to
trust the model (``confidence``). The finding is raised only when the gain is worth a restart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import median
from typing import Any

from ddpdoctor.analysis.bucket_sim import (
    CANDIDATE_CAPS_MB,
    HookCost,
    Prediction,
    current_prediction,
    hook_cost,
    predict,
    samples_of,
)
from ddpdoctor.analysis.comm_model import CommModel, fit_comm_model
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.events import Header, Step, Unused

#: A recommendation is made from this predicted gain (share of the step, and absolute) ...
MIN_GAIN_SHARE, MIN_GAIN_MS = 0.05, 0.5
#: ... and is a warning from this one (with a model that predicts the run itself within 15%).
WARN_GAIN_SHARE, WARN_GAIN_MS = 0.15, 5.0
#: Sampled steps needed per rank.
MIN_SAMPLES = 3


def cap_text(mb: float) -> str:
    """A bucket cap in MiB as a person set it: DDP keeps ``int(0.01 * 2**20)`` bytes, which reads
    0.00999928 MiB back; three significant digits give 0.01 again."""
    return f"{mb:.3g}"


def same_cap(a: float, b: float) -> bool:
    """Two caps in MiB that are one setting (one read back from DDP's bytes, one as set)."""
    return abs(a - b) <= 1e-3 * max(a, b)


@dataclass(frozen=True)
class RankBackward:
    """What the what-if needs of one rank: its header, recent steps and sampled backward passes.

    ``unused`` records carry the per-parameter ready times (``param_ready_us``) of sampled steps.
    ``rewrapped``: the model was wrapped anew mid-run (more than one header), so its backward
    passes are not one model's and the rank is left out.
    """

    header: Header | None
    steps: Sequence[Step]
    unused: Sequence[Unused] = ()
    rewrapped: bool = False


@dataclass
class WhatIf:
    """The simulator's answer for one run."""

    model: CommModel
    hook: HookCost
    measured_step_ms: float
    current: Prediction
    candidates: list[Prediction]
    samples: int
    calibration_error_pct: float  # |predicted - measured| / measured for the run's own configuration, before
    # the model's fixed cost per all-reduce was adjusted so that it reproduces that measurement

    @property
    def best(self) -> Prediction:
        return min(self.candidates, key=lambda p: (round(p.step_ms, 3), abs(p.cap_mb - self.current.cap_mb)))

    @property
    def best_other(self) -> Prediction | None:
        """The best candidate other than the run's own cap (None if there is none)."""
        others = [p for p in self.candidates if not same_cap(p.cap_mb, self.current.cap_mb)]
        return min(others, key=lambda p: (round(p.step_ms, 3), p.cap_mb)) if others else None

    @property
    def confidence(self) -> str:
        if self.calibration_error_pct <= 15 and self.samples >= 5 and self.model.median_abs_error_pct <= 30:
            return "high"
        return "medium" if self.calibration_error_pct <= 30 else "low"

    def to_dict(self) -> dict[str, Any]:
        return {
            "measured_step_ms": round(self.measured_step_ms, 3),
            "current": {
                "bucket_cap_mb": self.current.cap_mb,
                "buckets": self.current.buckets,
                "predicted_step_ms": round(self.current.step_ms, 3),
            },
            "candidates": [
                {"bucket_cap_mb": p.cap_mb, "buckets": p.buckets, "predicted_step_ms": round(p.step_ms, 3)}
                for p in self.candidates
            ],
            "comm_model": {
                "latency_us": round(self.model.latency_us, 1),
                "bandwidth_GBps": round(self.model.bandwidth_gbps, 3),
                "samples": self.model.samples,
                "bucket_sizes": self.model.sizes,
                "r2": round(self.model.r2, 3),
                "median_abs_error_pct": round(self.model.median_abs_error_pct, 1),
            },
            "hook_cost": {
                "fixed_us": round(self.hook.fixed_us, 1),
                "us_per_MiB": round(self.hook.us_per_byte * 2**20, 1),
            },
            "sampled_steps": self.samples,
            "calibration_error_pct": round(self.calibration_error_pct, 1),
            "confidence": self.confidence,
        }


def _as_list(items: Sequence[Any]) -> list[Any]:
    return items if isinstance(items, list) else list(items)  # a loaded run's lists are not copied


def what_if(ranks: Mapping[int, RankBackward], caps_mb: tuple[float, ...] = CANDIDATE_CAPS_MB) -> WhatIf | None:
    """Predicted step time per bucket cap for a run's ranks (None when they lack the samples)."""
    steps_by_rank = {r: _as_list(log.steps) for r, log in ranks.items()}
    model = fit_comm_model(steps_by_rank)
    if model is None:
        return None
    per_rank = []
    for log in ranks.values():
        if log.header is None or log.rewrapped:
            continue  # a rewrapped model changed its parameters mid-run: not one backward to replay
        steps = _as_list(log.steps)
        samples = samples_of(log.header, _as_list(log.unused), steps)
        if len(samples) >= MIN_SAMPLES:
            per_rank.append((log.header, samples, hook_cost(steps[-200:])))
    if not per_rank:
        return None
    # the rank with the smallest measured steps waited least for others: its backward is the job's own
    header, samples, hook = min(per_rank, key=lambda t: median(s.measured_step_us for s in t[1]))
    measured = median(s.measured_step_us for s in samples) / 1000.0
    current = current_prediction(header, samples, model, hook)
    error_pct = 100.0 * abs(current.step_ms - measured) / measured
    if current.buckets:
        # What the replay misses of the run's own step (thread hand-offs, completions that arrive
        # late and out of order) is charged to each all-reduce's fixed cost: the one term the
        # per-bucket samples cannot pin down when every bucket has the same size.
        extra_us = (measured - current.step_ms) * 1000.0 / current.buckets
        model = replace(model, latency_us=max(0.0, model.latency_us + extra_us))
        current = current_prediction(header, samples, model, hook)
    caps = sorted(set(caps_mb) | {round(current.cap_mb, 3)})
    candidates = predict(header, samples, model, hook, caps)
    return WhatIf(
        model=model,
        hook=hook,
        measured_step_ms=measured,
        current=current,
        candidates=candidates,
        samples=len(samples),
        calibration_error_pct=error_pct,
    )


def bucket_size(ranks: Mapping[int, RankBackward]) -> list[Finding]:
    """The ``bucket-size`` finding, when another cap is predicted to be worth it."""
    w = what_if(ranks)
    if w is None:
        return []
    best = w.best
    gain_ms = w.current.step_ms - best.step_ms
    share = gain_ms / w.current.step_ms if w.current.step_ms > 0 else 0.0
    if share < MIN_GAIN_SHARE or gain_ms < MIN_GAIN_MS or same_cap(best.cap_mb, w.current.cap_mb):
        return []
    warn = share >= WARN_GAIN_SHARE and gain_ms >= WARN_GAIN_MS and w.confidence == "high"
    predicted_ms = w.measured_step_ms * (1.0 - share)
    return [
        Finding(
            code="bucket-size",
            severity="warning" if warn else "info",
            ranks=sorted(ranks),
            step=None,
            title=(
                f"bucket_cap_mb={cap_text(best.cap_mb)} is predicted to make the step {share:.0%} faster "
                f"({w.measured_step_ms:.1f} -> {predicted_ms:.1f} ms; {w.confidence} confidence)"
            ),
            detail=(
                f"Replaying the measured backward ({w.samples} sampled steps) with a communication model fitted "
                f"to this run's all-reduces (latency {w.model.latency_us:.0f} µs, {_bandwidth(w.model)}) predicts "
                f"{best.step_ms:.1f} ms per step with {_buckets(best.buckets)} of up to {cap_text(best.cap_mb)} MiB, "
                f"against {w.current.step_ms:.1f} ms with the current {_buckets(w.current.buckets)} "
                f"(cap {cap_text(w.current.cap_mb)} MiB). Before calibration the model predicted the current "
                f"configuration within {w.calibration_error_pct:.0f}% of the measured {w.measured_step_ms:.1f} ms; "
                "the rest was "
                "charged to each all-reduce's fixed cost."
            ),
            evidence={
                "recommended_bucket_cap_mb": best.cap_mb,
                "predicted_gain_ms": round(gain_ms, 3),
                "predicted_gain_share": round(share, 4),
                "predicted_step_ms": round(predicted_ms, 3),
                **w.to_dict(),
            },
            fix=f"DistributedDataParallel(model, bucket_cap_mb={cap_text(best.cap_mb)}), then compare the step time "
            "in the report.",
        )
    ]


def _buckets(n: int) -> str:
    return f"{n} bucket{'s' if n != 1 else ''}"


def _bandwidth(model: CommModel) -> str:
    """The fitted bandwidth, or why there is none (durations that do not grow with the bytes)."""
    if model.us_per_byte <= 0:
        return "no time per byte measurable: the all-reduces took as long whatever their size"
    return f"{model.bandwidth_gbps:.2f} GB/s"
