"""Advice for communication-bound steps, measured from the run: the predicted step time with a
gradient compression hook (half the bytes on the wire) and with the bucket size the what-if
recommends, added to the ``exposed-communication`` finding.

Both come from the same replay (``bucket_sim``) of the run's sampled backward passes with the
communication model fitted to its own all-reduces (``comm_model``), calibrated by ``bucket_size``
so that it reproduces the measured step; a compression hook is modelled as the same all-reduce on
half the bytes (same fixed cost per all-reduce). The casts the hook adds on the training thread
are not modelled: on a GPU they are small next to the transfer they halve.
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median
from typing import Any

from ddpdoctor.analysis.bucket_sim import DEFAULT_CAP_MB, MIB, current_prediction, hook_cost, predict_cap, samples_of
from ddpdoctor.analysis.bucket_size import MIN_SAMPLES, cap_text, same_cap
from ddpdoctor.analysis.comm_hooks import comm_hook_name
from ddpdoctor.analysis.comm_hooks import compressing as is_compressing
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.from_run import what_if_run
from ddpdoctor.runlog import Run

#: Hooks that already compress: nothing to predict.
HOOK_FIX = (
    "Halve the bytes on the wire with a compression hook (gradients are all-reduced in 16 bits, then cast "
    "back):\n"
    "    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
    "    model.register_comm_hook(None, default_hooks.bf16_compress_hook)  # NCCL; fp16_compress_hook elsewhere"
)


def _job(run: Run) -> tuple[Any, list[Any], Any] | None:
    """The header, sampled backward passes and hook cost of the rank whose steps were shortest
    (it waited least for the others: its step is the job's own), as the what-if picks them."""
    per_rank = []
    for log in run.ranks.values():
        if log.header is None or len(log.headers) > 1:
            continue
        samples = samples_of(log.header, log.unused, log.steps)
        if len(samples) >= MIN_SAMPLES:
            per_rank.append((log.header, samples, hook_cost(log.steps[-200:])))
    if not per_rank:
        return None
    return min(per_rank, key=lambda t: median(s.measured_step_us for s in t[1]))


def communication_predictions(run: Run, exposed: Finding) -> dict[str, Any]:
    """Predicted step times (ms) with a compression hook and with the recommended bucket size."""
    step_ms = exposed.evidence.get("step_ms")
    hook_name = comm_hook_name(run.ranks.values())
    compressing = is_compressing(hook_name)
    out: dict[str, Any] = {"comm_hook": hook_name or "default"}
    w = what_if_run(run)
    job = _job(run) if w is not None else None
    if w is not None and job is not None and w.current.step_ms > 0:
        header, samples, hook = job
        scale = w.measured_step_ms / w.current.step_ms  # prediction against prediction, in measured ms
        half = replace(w.model, us_per_byte=w.model.us_per_byte / 2)
        best = w.best
        other = w.best_other
        out.update(
            method="replay",
            measured_step_ms=round(w.measured_step_ms, 3),
            confidence=w.confidence,
            calibration_error_pct=round(w.calibration_error_pct, 1),
            current_bucket_cap_mb=w.current.cap_mb,
            current_buckets=w.current.buckets,
            recommended_bucket_cap_mb=best.cap_mb,
            best_is_current=same_cap(best.cap_mb, w.current.cap_mb),
            bucket_cap_step_ms=round(best.step_ms * scale, 3),
        )
        if other is not None:
            out.update(best_other_bucket_cap_mb=other.cap_mb, best_other_step_ms=round(other.step_ms * scale, 3))
        if not compressing:
            compressed = current_prediction(header, samples, half, hook)
            both = predict_cap(header, samples, half, hook, int(best.cap_mb * MIB), int(best.cap_mb * MIB))
            out.update(
                compress_hook_step_ms=round(compressed.step_ms * scale, 3),
                compress_and_bucket_step_ms=round(both.step_ms * scale, 3),
            )
        return out
    # no sampled backward to replay: the exposed part of the all-reduce, halved, is what compression saves
    exposed_ms, comm_ms = exposed.evidence.get("exposed_ms"), exposed.evidence.get("allreduce_ms")
    if step_ms and exposed_ms is not None and comm_ms is not None and not compressing:
        out.update(
            method="exposed time",
            measured_step_ms=round(step_ms, 3),
            compress_hook_step_ms=round(step_ms - min(exposed_ms, comm_ms / 2), 3),
        )
    return out


def advise_communication(run: Run, exposed: Finding) -> Finding:
    """The ``exposed-communication`` finding with the predicted step times added (a warning only:
    a step that is not communication-bound needs no advice)."""
    if exposed.severity != "warning":
        return _cap_aware(run, exposed)
    p = communication_predictions(run, exposed)
    measured = p.get("measured_step_ms")
    if measured is None:
        return exposed
    parts, fixes = [], []
    if "compress_hook_step_ms" in p:
        parts.append(
            f"with bf16_compress_hook/fp16_compress_hook (half the bytes) about {p['compress_hook_step_ms']:.1f} ms"
        )
        fixes.append(HOOK_FIX)
    if "bucket_cap_step_ms" in p:
        bucket_part, bucket_fix = _bucket_advice(p, measured)
        parts.append(bucket_part)
        if bucket_fix:
            fixes.append(bucket_fix)
    if "compress_and_bucket_step_ms" in p and len(fixes) == 2:
        parts.append(f"with both about {p['compress_and_bucket_step_ms']:.1f} ms")
    if not fixes:
        return _cap_aware(run, exposed)
    how = (
        "replaying the sampled backward with the communication model fitted to this run"
        if p.get("method") == "replay"
        else "halving the exposed all-reduce time"
    )
    detail = f"{exposed.detail} Predicted step ({how}), against {measured:.1f} ms measured: " + "; ".join(parts) + "."
    return replace(
        exposed,
        detail=detail,
        evidence={**exposed.evidence, "predicted": p},
        fix="\n".join(fixes) + "\nIf ranks wait for a straggler, fix that first.",
    )


def _bucket_advice(p: dict[str, Any], measured: float) -> tuple[str, str]:
    """The bucket part of the advice (a clause of the detail, and a fix or ""), never naming the
    run's own cap as a "best" to move to, and saying so where the replay cannot predict the run."""
    current = cap_text(p["current_bucket_cap_mb"])
    low = p.get("confidence") == "low"
    if not p["best_is_current"] and p["bucket_cap_step_ms"] < measured * 0.98:
        cap = cap_text(p["recommended_bucket_cap_mb"])
        saving = measured - p["bucket_cap_step_ms"]
        larger = p["recommended_bucket_cap_mb"] > p["current_bucket_cap_mb"]
        why = (
            "fewer all-reduces, each with its fixed cost"
            if larger
            else "all-reduces that start earlier, while backward runs"
        )
        trust = (
            f"; low confidence: before calibration the replay missed this run's step by "
            f"{p['calibration_error_pct']:.0f}%, try it and compare"
            if low
            else ""
        )
        return (
            f"with bucket_cap_mb={cap} about {p['bucket_cap_step_ms']:.1f} ms ({saving:.1f} ms saved: {why}{trust})",
            f"{why[0].upper()}{why[1:]}: DistributedDataParallel(net, bucket_cap_mb={cap}).",
        )
    if low:  # "nothing helps" is a prediction too: not made by a replay that misses the run
        return (
            f"the bucket replay cannot predict this run (before calibration it missed the measured step by "
            f"{p['calibration_error_pct']:.0f}%), so it says nothing of bucket_cap_mb",
            "",
        )
    if p["best_is_current"]:
        return f"no other bucket_cap_mb is predicted to help: the current {current} MiB is predicted best", ""
    other = cap_text(p.get("best_other_bucket_cap_mb", p["recommended_bucket_cap_mb"]))
    return (
        f"no bucket_cap_mb is predicted to save 2% or more (the best other, {other} MiB, about "
        f"{p.get('best_other_step_ms', p['bucket_cap_step_ms']):.1f} ms)",
        "",
    )


def _cap_aware(run: Run, exposed: Finding) -> Finding:
    """The finding's generic fix ("a smaller bucket_cap_mb") is wrong for a run whose cap is already
    below the default: there each all-reduce's fixed cost is what a smaller cap adds."""
    header = next((log.header for log in run.ranks.values() if log.header is not None), None)
    cap = header.ddp_options.get("bucket_bytes_cap") if header is not None else None
    if not cap or int(cap) >= DEFAULT_CAP_MB * MIB or "a smaller bucket_cap_mb" not in exposed.fix:
        return exposed
    mb = cap_text(int(cap) / MIB)
    return replace(
        exposed,
        fix=(
            f"The bucket cap is already small (bucket_cap_mb={mb}): a smaller one adds all-reduces, each with its "
            "fixed cost. Compare a run at the default (25) or a few MiB (see bucket-size for the predicted step); "
            "a compression hook halves the bytes. If ranks wait for a straggler, fix that first."
        ),
    )
