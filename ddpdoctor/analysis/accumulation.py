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


UNSYNCED_CODE = "gradients-never-synchronized"

UNSYNCED_FIX = (
    "The backward right before optimizer.step() must run outside no_sync(): DDP all-reduces only then (the "
    "gradients accumulated in the micro-steps before it are summed into that all-reduce). An off-by-one in the "
    "accumulation test is the usual cause:\n"
    "    for i, batch in enumerate(loader):\n"
    "        last = (i + 1) % accumulation_steps == 0\n"
    "        with contextlib.nullcontext() if last else model.no_sync():\n"
    "            loss = model(batch).mean() / accumulation_steps\n"
    "            loss.backward()\n"
    "        if last:\n"
    "            optimizer.step()\n"
    "            optimizer.zero_grad()"
)


def unsynced_updates(rank: int, step: int, updates: int, micro: int, ever_synced: bool) -> Finding:
    """``updates`` optimizer steps (weights changed) whose backward just before ran inside
    ``no_sync()``: what they applied was this rank's own gradient (``ever_synced``: some backward
    of this DDP all-reduced before; else none ever did)."""
    if ever_synced:
        what = (
            f"{updates} optimizer steps changed the weights right after a backward that ran inside no_sync(): "
            "the gradient they applied holds this rank's own micro-steps since the last all-reduce, never "
            "synchronized"
        )
    else:
        what = (
            f"{updates} optimizer steps changed the weights and no gradient was ever all-reduced: every "
            f"backward so far ({micro} of them) ran inside no_sync()"
        )
    return Finding(
        code=UNSYNCED_CODE,
        severity="error",
        ranks=[rank],
        step=step,
        title="Optimizer steps with no all-reduce behind them: gradients never synchronized",
        detail=(
            f"{what}. Each rank updates its weights with its own gradient: the replicas drift apart silently "
            "(unless the script all-reduces the gradients itself)."
        ),
        evidence={"optimizer_steps": updates, "backwards_in_no_sync": micro, "ever_synchronized": ever_synced},
        fix=UNSYNCED_FIX,
    )
