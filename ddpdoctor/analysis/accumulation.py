"""sync-during-accumulation: several synchronized backwards per optimizer step."""

from __future__ import annotations

from statistics import median

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.sizes import human_bytes
from ddpdoctor.events import Step


def sync_during_accumulation(steps: list[Step], rank: int) -> list[Finding]:
    """Optimizer cycles in which more than one backward all-reduced its gradients."""
    cycles: list[list[Step]] = []
    current: list[Step] = []
    for s in steps:
        if not s.bucket_count():
            continue
        current.append(s)
        if s.opt_start_us is not None:
            cycles.append(current)
            current = []
    accumulating = [c for c in cycles if len(c) > 1]
    if not accumulating or len(accumulating) < max(1, len(cycles) // 2):
        return []
    per_opt = median(len(c) for c in accumulating)
    wasted = [s for c in accumulating for s in c[:-1]]
    ar_ms = [
        (s.sync_end_us - span[0]) / 1000.0
        for s in wasted
        if s.sync_end_us is not None and (span := s.ready_span_us()) is not None
    ]
    nbytes = median(s.bucket_bytes() for s in wasted)
    return [
        Finding(
            code="sync-during-accumulation",
            severity="warning",
            ranks=[rank],
            step=accumulating[0][0].step,
            title=f"gradient accumulation all-reduces at every micro-step ({per_opt:g} per optimizer step)",
            detail=(
                f"{len(accumulating)} optimizer steps each followed {per_opt:g} synchronized backwards: all but the "
                f"last all-reduced {human_bytes(nbytes)} of gradients for nothing"
                f"{f' ({median(ar_ms):.2f} ms each)' if ar_ms else ''}."
            ),
            evidence={
                "optimizer_steps": len(accumulating),
                "backwards_per_optimizer_step": per_opt,
                "wasted_allreduce_ms_per_micro_step": median(ar_ms) if ar_ms else None,
                "wasted_bytes_per_micro_step": nbytes,
            },
            fix=(
                "Skip the all-reduce on all but the last micro-step:\n"
                "    for i, (x, y) in enumerate(batches):\n"
                "        ctx = model.no_sync() if (i + 1) % accum_steps else contextlib.nullcontext()\n"
                "        with ctx:\n"
                "            loss_fn(model(x), y).backward()\n"
                "        if (i + 1) % accum_steps == 0:\n"
                "            optimizer.step(); optimizer.zero_grad()"
            ),
        )
    ]
