"""Where one step's time went on one rank: durations derived from a Step record."""

from __future__ import annotations

from ddpdoctor.events import Step

#: Phase names, in timeline order, with what each means (shown by the report).
PHASES: dict[str, str] = {
    "step": "whole step, first forward to the next step's first forward",
    "accumulation": "no_sync micro-steps before the synchronizing forward",
    "forward": "forward compute, buffer broadcast excluded",
    "buffer_sync": "broadcast of module buffers from rank 0 inside forward",
    "backward": "end of forward to end of backward compute (loss included)",
    "allreduce": "first bucket ready to last bucket all-reduced",
    "exposed_comm": "communication not hidden behind backward compute",
    "optimizer": "optimizer.step()",
    "rest": "after gradients are synchronized until the next step (optimizer, data loading)",
}


def _diff(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return b - a


def step_phases(s: Step) -> dict[str, float | None]:
    """Phase durations in milliseconds (None where the log does not tell)."""
    if s.summary:
        span = s.ready_span_us()
        first_ready = span[0] if span else None
    else:
        ready = [t for t in s.b_ready_us if t is not None]
        first_ready = min(ready) if ready else None
    exposed = _diff(s.bwd_end_us, s.sync_end_us)
    out_us = {
        "step": s.end_us,
        "accumulation": s.fwd_start_us if s.micro else 0.0,
        "forward": s.fwd_us,
        "buffer_sync": s.bcast_us if s.bcast_us is not None else 0.0,
        "backward": _diff(s.fwd_end_us, s.bwd_end_us),
        "allreduce": _diff(first_ready, s.sync_end_us),
        "exposed_comm": max(0.0, exposed) if exposed is not None else None,
        "optimizer": _diff(s.opt_start_us, s.opt_end_us),
        "rest": _diff(s.sync_end_us, s.end_us),
    }
    return {k: (None if v is None else v / 1000.0) for k, v in out_us.items()}
