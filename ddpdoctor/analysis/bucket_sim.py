"""Replaying a measured backward under other bucket layouts: predicted step time per ``bucket_cap_mb``.

Inputs, all measured in the run: when each parameter's gradient was ready (sampled steps), the
communication cost model (``comm_model``), the time DDP's comm hook takes per bucket on the
training thread, and what the step spends after the last all-reduce (optimizer, data).

DDP's rules (torch 2.x, as in ``distributed.py`` and the reducer): the first iteration runs with
an initial layout, then the buckets are rebuilt once in the order the gradients became ready;
a bucket closes when it reaches its byte cap; the first bucket's cap is 1 MiB
(``first_bucket_bytes_cap``) only when ``bucket_cap_mb`` was left at its default, otherwise
every bucket gets ``bucket_cap_mb``. Buckets are per dtype. A bucket's all-reduce is launched
when its last gradient is ready and the process group runs them one after another.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from ddpdoctor.analysis.comm_model import CommModel, fit_line
from ddpdoctor.analysis.sizes import dtype_bytes
from ddpdoctor.events import Header, Step, Unused

MIB = 1 << 20
#: The caps the simulator tries (MiB), besides the run's own.
CANDIDATE_CAPS_MB = (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)
DEFAULT_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB


@dataclass
class BackwardSample:
    """One sampled step on one rank: per reduced parameter its ready time (µs from step start)."""

    step: int
    ready_us: dict[int, float]  # parameter index -> ready
    bwd_end_us: float
    after_sync_us: float  # what the step spends after its last all-reduce (optimizer, data loading)
    measured_step_us: float
    measured_buckets: list[float]  # measured bucket ready times (which hooks ran before each gradient)
    measured_bytes: list[int]


def assign_buckets(
    order: list[int], nbytes: dict[int, int], dtypes: dict[int, str], cap: int, first_cap: int
) -> list[list[int]]:
    """DDP's rebuilt layout: parameters in ready order, a bucket closes once it holds ``cap`` bytes
    (the first one ``first_cap``), one running bucket per dtype."""
    buckets: list[list[int]] = []
    open_: dict[str, tuple[list[int], int]] = {}
    started: set[str] = set()
    for i in order:
        key = dtypes[i]
        members, size = open_.get(key, ([], 0))
        members.append(i)
        size += nbytes[i]
        limit = cap if key in started else first_cap
        if size >= limit:
            buckets.append(members)
            started.add(key)
            open_.pop(key, None)
        else:
            open_[key] = (members, size)
    buckets += [members for members, _ in open_.values()]
    return buckets


def replay(
    sample: BackwardSample, buckets: list[list[int]], nbytes: dict[int, int], model: CommModel, hook: HookCost
) -> float:
    """Predicted step time (µs) of ``sample`` with ``buckets``."""
    # ready times without the delay the measured hooks added to later gradients
    measured = sorted(zip(sample.measured_buckets, sample.measured_bytes, strict=False))
    base = {i: t - sum(hook.us(n) for r, n in measured if r < t) for i, t in sample.ready_us.items()}
    ready_at = sorted((max(base[i] for i in b), sum(nbytes[i] for i in b)) for b in buckets if b)
    delay, end = 0.0, 0.0
    for t, size in ready_at:
        delay += hook.us(size)  # its own hook, after every earlier one, holds the training thread
        end = max(end, t + delay) + model.predict_us(size)
    bwd_end = sample.bwd_end_us - sum(hook.us(n) for _, n in measured) + delay
    return max(end, bwd_end) + sample.after_sync_us


@dataclass
class Prediction:
    cap_mb: float
    buckets: int
    step_ms: float  # predicted median step time


def samples_of(header: Header, unused: list[Unused], steps: list[Step], skip_steps: int = 2) -> list[BackwardSample]:
    """The sampled steps of one rank that have per-parameter ready times and a complete step record."""
    by_step = {s.step: s for s in steps}
    out = []
    for u in unused:
        s = by_step.get(u.step)
        if (
            u.step < skip_steps
            or s is None
            or not u.param_ready_us
            or s.end_us is None
            or s.sync_end_us is None
            or s.bwd_end_us is None
            or None in s.b_ready_us
        ):
            continue
        ready = {
            i: t
            for i, t in enumerate(u.param_ready_us)
            if t is not None and i < len(header.params) and header.params[i].reduced
        }
        if not ready:
            continue
        out.append(
            BackwardSample(
                step=u.step,
                ready_us=ready,
                bwd_end_us=s.bwd_end_us,
                after_sync_us=s.end_us - s.sync_end_us,
                measured_step_us=s.end_us,
                measured_buckets=[t for t in s.b_ready_us if t is not None],  # (None ruled out above)
                measured_bytes=list(s.b_bytes),
            )
        )
    return out


@dataclass(frozen=True)
class HookCost:
    """Time the comm hook holds the training thread per bucket (dividing by the world size, copying,
    launching): ``fixed_us + nbytes * us_per_byte``. Gradients computed after it wait for it."""

    fixed_us: float = 0.0
    us_per_byte: float = 0.0

    def us(self, nbytes: float) -> float:
        return self.fixed_us + nbytes * self.us_per_byte


def hook_cost(steps: list[Step], skip_steps: int = 2) -> HookCost:
    """Fitted from each bucket's ready and launch marks."""
    points = [
        (int(n), la - r)
        for s in steps
        if s.step >= skip_steps
        for r, la, n in zip(s.b_ready_us, s.b_launch_us, s.b_bytes, strict=False)
        if r is not None and la is not None and n is not None
    ]
    line = fit_line(points)
    return HookCost(line[0], line[1]) if line else HookCost()


def predict_cap(
    header: Header, samples: list[BackwardSample], model: CommModel, hook: HookCost, cap: int, first_cap: int
) -> Prediction:
    """Predicted median step time with buckets of ``cap`` bytes (the first one ``first_cap``)."""
    nbytes = {i: p.numel * dtype_bytes(p.dtype) for i, p in enumerate(header.params)}
    dtypes = {i: p.dtype for i, p in enumerate(header.params)}
    times, count = [], 0
    for sample in samples:
        order = sorted(sample.ready_us, key=sample.ready_us.__getitem__)
        buckets = assign_buckets(order, nbytes, dtypes, cap, first_cap)
        count = len(buckets)
        times.append(replay(sample, buckets, nbytes, model, hook))
    return Prediction(cap_mb=cap / MIB, buckets=count, step_ms=median(times) / 1000.0)


def predict(
    header: Header, samples: list[BackwardSample], model: CommModel, hook: HookCost, caps_mb: list[float]
) -> list[Prediction]:
    """Predicted median step time for each ``bucket_cap_mb`` set explicitly (every bucket that size)."""
    return [predict_cap(header, samples, model, hook, int(c * MIB), int(c * MIB)) for c in caps_mb]


def current_prediction(header: Header, samples: list[BackwardSample], model: CommModel, hook: HookCost) -> Prediction:
    """The run's own configuration, with its first-bucket rule, for calibration."""
    opts = header.ddp_options
    cap = int(opts.get("bucket_bytes_cap") or DEFAULT_CAP_MB * MIB)
    first = int(opts.get("first_bucket_bytes_cap") or cap)
    return predict_cap(header, samples, model, hook, cap, first)
