"""bucket-size: a better ``bucket_cap_mb``, predicted from the run's own measurements.

The simulator (``bucket_sim``) predicts the step time for the run's configuration and for each
candidate cap. Gains are judged prediction against prediction (the model's own bias cancels);
the prediction for the run's own configuration against its measured step time says how far to
trust the model (``confidence``). A cap is recommended only when its predicted saving is worth a
restart in three of four replayed steps (each with its own backward: the run's own noise), by a
replay that reproduces the run; where
the buckets all had one size, the saving must hold whether an all-reduce's time is all fixed
cost or all per byte (the samples cannot tell). Otherwise the answer says why it names no cap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import median, quantiles
from typing import Any

from ddpdoctor.analysis.bucket_sim import (
    CANDIDATE_CAPS_MB,
    HookCost,
    JobSample,
    Prediction,
    current_prediction,
    hook_cost,
    job_samples,
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
#: Ranks replayed at most.
MAX_REPLAYED_RANKS = 16


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
    """The simulator's answer for one run: a prediction per cap, and the cap it recommends (or why none)."""

    model: CommModel
    hook: HookCost
    measured_step_ms: float
    current: Prediction
    candidates: list[Prediction]
    samples: int
    calibration_error_pct: float  # |predicted - measured| / measured for the run's own configuration
    job: tuple[Header, list[JobSample]]  # what was replayed, for other what-ifs (a compression hook)
    recommended: Prediction | None = None
    gain_ms: float = 0.0  # its predicted saving (median over the replayed steps; at the worse extreme, one size)
    low_gain_ms: float = 0.0  # what it saves in three of four replayed steps
    gain_range_ms: tuple[float, float] | None = None  # the best other cap's saving at both extremes (one size)
    verdict: str = ""  # why no cap is recommended ("" when one is)

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
            **({"verdict": self.verdict} if self.verdict else {}),
        }


def _as_list(items: Sequence[Any]) -> list[Any]:
    return items if isinstance(items, list) else list(items)  # a loaded run's lists are not copied


def job_of(ranks: Mapping[int, RankBackward]) -> tuple[Header, list[JobSample]] | None:
    """A header and the sampled steps lined up across the ranks (None when too few steps were
    sampled on every rank)."""
    per_rank = {}
    for r, log in ranks.items():
        if log.header is None or log.rewrapped:
            continue  # a rewrapped model changed its parameters mid-run: not one backward to replay
        steps = _as_list(log.steps)
        samples = samples_of(log.header, _as_list(log.unused), steps)
        if len(samples) >= MIN_SAMPLES:
            per_rank[r] = (samples, hook_cost(steps[-200:]))
    if len(per_rank) > MAX_REPLAYED_RANKS:
        # the ranks whose backward ends latest set when each all-reduce can start (a replay costs
        # per rank: a large job's report replays these, not every rank)
        late = sorted(per_rank, key=lambda r: median(s.bwd_end_us for s in per_rank[r][0]))
        per_rank = {r: per_rank[r] for r in late[-MAX_REPLAYED_RANKS:]}
    jobs = job_samples(per_rank)
    header = ranks[min(per_rank)].header if per_rank else None
    return (header, jobs) if header is not None and len(jobs) >= MIN_SAMPLES else None


def savings(current: Prediction, other: Prediction) -> tuple[float, float]:
    """(median, lower quartile) over the replayed steps of what ``other`` saves against ``current``:
    each step replayed with its own backward, so the run's step-to-step noise is in their spread."""
    gains = sorted(a - b for a, b in zip(current.per_sample_ms, other.per_sample_ms, strict=True))
    low = quantiles(gains, n=4)[0] if len(gains) >= 4 else gains[0]
    return median(gains), low


def what_if(ranks: Mapping[int, RankBackward], caps_mb: tuple[float, ...] = CANDIDATE_CAPS_MB) -> WhatIf | None:
    """Predicted step time per bucket cap for a run's ranks (None when they lack the samples)."""
    job = job_of(ranks)
    if job is None:
        return None
    header, jobs = job
    model = fit_comm_model({r: _as_list(log.steps) for r, log in ranks.items()})
    if model is None:
        return None
    measured = median(j.measured_step_us for j in jobs) / 1000.0
    current = current_prediction(header, jobs, model)
    caps = sorted(set(caps_mb) | {round(current.cap_mb, 3)})
    w = WhatIf(
        model=model,
        hook=jobs[-1].passes[0].hook,
        measured_step_ms=measured,
        current=current,
        candidates=predict(header, jobs, model, caps),
        samples=len(jobs),
        calibration_error_pct=100.0 * abs(current.step_ms - measured) / measured,
        job=job,
    )
    _recommend(w, header, jobs)
    return w


def _recommend(w: WhatIf, header: Header, jobs: list[JobSample]) -> None:
    """Sets ``w``'s recommendation, or its verdict on why there is none. A cap is recommended where
    it saves enough in three of four replayed steps (the run's own noise), by a replay that
    reproduces the run; with one bucket size, at both extremes of the fixed / per-byte split."""
    need = max(MIN_GAIN_MS, MIN_GAIN_SHARE * w.current.step_ms)
    others = [p for p in w.candidates if not same_cap(p.cap_mb, w.current.cap_mb)]
    if not others:
        w.verdict = "no other bucket_cap_mb to try"
        return
    saved = {p.cap_mb: savings(w.current, p) for p in others}
    best_point = max(saved, key=lambda c: (round(saved[c][0], 3), -c))
    if not w.model.split_known:
        # one bucket size: what a cap saves is the lesser of the two extremes
        caps = sorted(saved)
        extremes = []
        for m in w.model.extremes():
            now = current_prediction(header, jobs, m)
            extremes.append({p.cap_mb: savings(now, p) for p in predict(header, jobs, m, caps)})
        saved = {
            c: (min(g[0], *(e[c][0] for e in extremes)), min(g[1], *(e[c][1] for e in extremes)))
            for c, g in saved.items()
        }
        w.gain_range_ms = (min(e[best_point][0] for e in extremes), max(e[best_point][0] for e in extremes))
    best = max(saved, key=lambda c: (round(saved[c][1], 3), -c))
    if w.confidence == "low":
        w.verdict = f"the replay cannot predict this run: it misses the measured step by {w.calibration_error_pct:.0f}%"
    elif saved[best][1] >= need:
        w.recommended = next(p for p in others if p.cap_mb == best)
        w.gain_ms, w.low_gain_ms = saved[best]
    elif w.gain_range_ms is not None and w.gain_range_ms[1] >= need:
        low, high = w.gain_range_ms
        w.verdict = (
            f"{_one_size(w.model)}, so how much of an all-reduce's time is a fixed cost is not measured: "
            f"bucket_cap_mb={cap_text(best_point)} would change the step by between {-high:+.1f} and {-low:+.1f} ms "
            "(a run at another cap would tell)"
        )
    else:
        w.verdict = (
            f"no other bucket_cap_mb is predicted to save {need:.1f} ms or more (5% of the step, 0.5 ms at least) "
            "in three of four replayed steps"
        )


def bucket_size(ranks: Mapping[int, RankBackward]) -> list[Finding]:
    """The ``bucket-size`` finding, when another cap is predicted to be worth it."""
    w = what_if(ranks)
    if w is None or w.recommended is None:
        return []
    best = w.recommended
    gain_ms = w.gain_ms
    share = gain_ms / w.current.step_ms if w.current.step_ms > 0 else 0.0
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
                f"Replaying the measured backward of every rank ({w.samples} sampled steps) with a communication "
                f"model fitted to this run's all-reduces (fixed cost {w.model.latency_us:.0f} µs each, "
                f"{_bandwidth(w.model)}) predicts {best.step_ms:.1f} ms per step with {_buckets(best.buckets)} of up "
                f"to {cap_text(best.cap_mb)} MiB, against {w.current.step_ms:.1f} ms with the current "
                f"{_buckets(w.current.buckets)} (cap {cap_text(w.current.cap_mb)} MiB): {gain_ms:.1f} ms saved, "
                f"at least {w.low_gain_ms:.1f} ms in three of four replayed steps. The same replay predicts the "
                f"current configuration within {w.calibration_error_pct:.0f}% of the measured "
                f"{w.measured_step_ms:.1f} ms."
                + (
                    f" {_one_size(w.model, capital=True)}: the saving holds whether their time is fixed or per byte."
                    if not w.model.split_known
                    else ""
                )
            ),
            evidence={
                "recommended_bucket_cap_mb": best.cap_mb,
                "predicted_gain_ms": round(gain_ms, 3),
                "predicted_gain_low_ms": round(w.low_gain_ms, 3),
                "predicted_gain_share": round(share, 4),
                "predicted_step_ms": round(predicted_ms, 3),
                **w.to_dict(),
            },
            fix=f"DistributedDataParallel(model, bucket_cap_mb={cap_text(best.cap_mb)}), then compare the step time "
            "in the report.",
        )
    ]


def _one_size(model: CommModel, capital: bool = False) -> str:
    """Why the fixed cost of an all-reduce is not measured: its sizes."""
    text = (
        f"every all-reduce had one size ({model.typical_bytes / 2**20:.3g} MiB)"
        if model.size_ratio <= 1.0
        else f"the all-reduces' sizes were within {model.size_ratio:.2g}x of each other"
    )
    return text[0].upper() + text[1:] if capital else text


def _buckets(n: int) -> str:
    return f"{n} bucket{'s' if n != 1 else ''}"


def _bandwidth(model: CommModel) -> str:
    """The fitted bandwidth, or why there is none (durations that do not grow with the bytes)."""
    if model.us_per_byte <= 0:
        return "no time per byte measurable: the all-reduces took as long whatever their size"
    return f"{model.bandwidth_gbps:.2f} GB/s"
