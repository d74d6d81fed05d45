"""Replaying a measured backward under other bucket layouts: predicted step time per ``bucket_cap_mb``.

Inputs, all measured in the run: when each parameter's gradient was ready on every rank (sampled
steps), the communication cost model (``comm_model``), the time DDP's comm hook takes per bucket
on the training thread, and what the step spends after the last all-reduce (optimizer, data).

DDP's rules (torch 2.x, as in ``distributed.py`` and the reducer): the first iteration runs with
an initial layout, then the buckets are rebuilt once in the order the gradients became ready
(rank 0's order, broadcast to the others); a bucket closes when it reaches its byte cap; the
first bucket's cap is 1 MiB (``first_bucket_bytes_cap``) only when ``bucket_cap_mb`` was left at
its default, otherwise every bucket gets ``bucket_cap_mb``. Buckets are per dtype, and launched
in their index order. A bucket's all-reduce starts once the last rank launched it and the one
before it is done (``comm_model``). A step ends on every rank when the last all-reduce is done
and that rank's backward is, plus what the rank spends after (optimizer, data).

The ranks' step clocks differ by when each started its step; a step's ranks are put on one clock
by their all-reduces' completions, which every rank sees at nearly the same moment.
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
#: Sampled steps replayed per cap: the most recent ones (a long run's thousands cost time, not accuracy).
MAX_SAMPLES = 32


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
    measured_done: list[float]  # each bucket's all-reduce completion, by bucket index (aligns the ranks)


@dataclass(frozen=True)
class HookCost:
    """Time the comm hook holds the training thread per bucket (dividing by the world size, copying,
    launching): ``fixed_us + nbytes * us_per_byte``. Gradients computed after it wait for it."""

    fixed_us: float = 0.0
    us_per_byte: float = 0.0

    def us(self, nbytes: float) -> float:
        return self.fixed_us + nbytes * self.us_per_byte


@dataclass
class RankPass:
    """One rank's part of a sampled step, on the step's common clock, with the time its measured
    comm hooks held the training thread taken out (the replay adds the new layout's back)."""

    base_ready: dict[int, float]  # parameter index -> ready
    bwd_end: float
    after_sync_us: float
    shift_us: float  # this rank's step clock less the common one
    hook: HookCost


@dataclass
class JobSample:
    """One sampled step across the ranks that logged it."""

    step: int
    passes: list[RankPass]
    order: list[int]  # the reference rank's parameters in ready order (DDP rebuilds from rank 0's)
    measured_step_us: float  # the slowest rank's step


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


def _launches(p: RankPass, buckets: list[list[int]], sizes: list[int]) -> tuple[list[float], float]:
    """When one rank launches each bucket (index order) and when its backward ends, with the new
    layout's hooks holding its training thread: a gradient computed after a hook ran waits for it."""
    out: list[float] = []
    held, last = 0.0, float("-inf")
    for members, size in zip(buckets, sizes, strict=True):
        # a parameter that got no gradient on this rank leaves the bucket to the others
        ready = max((p.base_ready[i] for i in members if i in p.base_ready), default=float("-inf")) + held
        hook = p.hook.us(size)
        last = max(ready, last) + hook  # DDP launches in index order
        held += hook
        out.append(last)
    return out, p.bwd_end + held


def replay(job: JobSample, buckets: list[list[int]], nbytes: dict[int, int], model: CommModel) -> float:
    """Predicted step time (µs) of ``job`` with ``buckets`` (index order)."""
    buckets = [b for b in buckets if b]
    sizes = [sum(nbytes[i] for i in b) for b in buckets]
    per_rank = [_launches(p, buckets, sizes) for p in job.passes]
    comm_end = float("-inf")
    for b, size in enumerate(sizes):
        # once the last rank launched it and the all-reduce before it is done
        comm_end = max(max(launch[b] for launch, _ in per_rank), comm_end) + model.predict_us(size)
    ends = zip(job.passes, per_rank, strict=True)
    return max(max(comm_end, bwd_end) + p.after_sync_us + p.shift_us for p, (_, bwd_end) in ends)


@dataclass
class Prediction:
    cap_mb: float
    buckets: int
    step_ms: float  # predicted median step time
    per_sample_ms: tuple[float, ...] = ()  # the prediction for each replayed step, in their order


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
            or None in s.b_done_us
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
                measured_done=[t for t in s.b_done_us if t is not None],
            )
        )
    return out


def _pass(sample: BackwardSample, hook: HookCost, shift_us: float) -> RankPass:
    """``sample`` on the common clock, less the time its measured hooks held the training thread."""
    measured = sorted(zip(sample.measured_buckets, sample.measured_bytes, strict=False))

    def held(t: float) -> float:
        return sum(hook.us(n) for r, n in measured if r < t)

    return RankPass(
        base_ready={i: t - held(t) - shift_us for i, t in sample.ready_us.items()},
        bwd_end=sample.bwd_end_us - sum(hook.us(n) for _, n in measured) - shift_us,
        after_sync_us=sample.after_sync_us,
        shift_us=shift_us,
        hook=hook,
    )


def job_samples(per_rank: dict[int, tuple[list[BackwardSample], HookCost]]) -> list[JobSample]:
    """The steps every given rank sampled, each rank's pass on the lowest rank's step clock (the
    median offset of their all-reduce completions), the most recent ``MAX_SAMPLES``."""
    if not per_rank:
        return []
    by_rank = {r: {s.step: s for s in samples} for r, (samples, _) in per_rank.items()}
    ref = min(per_rank)
    common = sorted(set.intersection(*(set(v) for v in by_rank.values())))[-MAX_SAMPLES:]
    out = []
    for step in common:
        own = by_rank[ref][step]
        n = len(own.measured_done)
        if any(len(by_rank[r][step].measured_done) != n for r in by_rank):
            continue  # a layout that differs between ranks: not one step to line up
        passes = []
        for r, (_, hook) in sorted(per_rank.items()):
            s = by_rank[r][step]
            shift = median(d - e for d, e in zip(s.measured_done, own.measured_done, strict=True)) if n else 0.0
            passes.append(_pass(s, hook, shift))
        out.append(
            JobSample(
                step=step,
                passes=passes,
                order=sorted(own.ready_us, key=own.ready_us.__getitem__),
                measured_step_us=max(by_rank[r][step].measured_step_us for r in by_rank),
            )
        )
    return out


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


def predict_cap(header: Header, jobs: list[JobSample], model: CommModel, cap: int, first_cap: int) -> Prediction:
    """Predicted median step time with buckets of ``cap`` bytes (the first one ``first_cap``)."""
    nbytes = {i: p.numel * dtype_bytes(p.dtype) for i, p in enumerate(header.params)}
    dtypes = {i: p.dtype for i, p in enumerate(header.params)}
    times, count = [], 0
    for job in jobs:
        buckets = assign_buckets(job.order, nbytes, dtypes, cap, first_cap)
        count = len(buckets)
        times.append(replay(job, buckets, nbytes, model) / 1000.0)
    return Prediction(cap_mb=cap / MIB, buckets=count, step_ms=median(times), per_sample_ms=tuple(times))


def predict(header: Header, jobs: list[JobSample], model: CommModel, caps_mb: list[float]) -> list[Prediction]:
    """Predicted median step time for each ``bucket_cap_mb`` set explicitly (every bucket that size)."""
    return [predict_cap(header, jobs, model, int(c * MIB), int(c * MIB)) for c in caps_mb]


def current_prediction(header: Header, jobs: list[JobSample], model: CommModel) -> Prediction:
    """The run's own configuration, with its first-bucket rule, for calibration."""
    opts = header.ddp_options
    cap = int(opts.get("bucket_bytes_cap") or DEFAULT_CAP_MB * MIB)
    first = int(opts.get("first_bucket_bytes_cap") or cap)
    return predict_cap(header, jobs, model, cap, first)
