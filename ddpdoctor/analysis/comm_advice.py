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
from typing import Any

from ddpdoctor.analysis.bucket_sim import DEFAULT_CAP_MB, MIB, current_prediction, predict_cap
from ddpdoctor.analysis.bucket_size import cap_text, savings
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


def communication_predictions(run: Run, exposed: Finding) -> dict[str, Any]:
    """Predicted step times (ms) with a compression hook and with the recommended bucket size."""
    step_ms = exposed.evidence.get("step_ms")
    hook_name = comm_hook_name(run.ranks.values())
    compressing = is_compressing(hook_name)
    out: dict[str, Any] = {"comm_hook": hook_name or "default"}
    w = what_if_run(run)
    if w is not None and w.current.step_ms > 0:
        header, jobs = w.job
        scale = w.measured_step_ms / w.current.step_ms  # prediction against prediction, in measured ms
        other = w.best_other
        out.update(
            method="replay",
            measured_step_ms=round(w.measured_step_ms, 3),
            confidence=w.confidence,
            calibration_error_pct=round(w.calibration_error_pct, 1),
            current_bucket_cap_mb=w.current.cap_mb,
            current_buckets=w.current.buckets,
        )
        if w.recommended is not None:
            out.update(
                recommended_bucket_cap_mb=w.recommended.cap_mb,
                bucket_cap_step_ms=round(w.measured_step_ms - w.gain_ms * scale, 3),
            )
        else:
            out.update(bucket_cap_verdict=w.verdict)
        if other is not None:
            out.update(best_other_bucket_cap_mb=other.cap_mb, best_other_step_ms=round(other.step_ms * scale, 3))
        if not compressing:
            half = replace(w.model, us_per_byte=w.model.us_per_byte / 2)
            # savings against the current replay, step by step, as the bucket cap's are
            compressed = savings(w.current, current_prediction(header, jobs, half))[0]
            out.update(compress_hook_step_ms=round(w.measured_step_ms - compressed * scale, 3))
            if w.recommended is not None:
                cap = int(w.recommended.cap_mb * MIB)
                both = savings(w.current, predict_cap(header, jobs, half, cap, cap))[0]
                out.update(compress_and_bucket_step_ms=round(w.measured_step_ms - both * scale, 3))
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
    if p.get("method") == "replay":
        bucket_part, bucket_fix = _bucket_advice(p)
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


def _bucket_advice(p: dict[str, Any]) -> tuple[str, str]:
    """The bucket part of the advice (a clause of the detail, and a fix or ""): a cap with its
    predicted saving where the what-if recommends one, else its verdict on why it names none
    (never the run's own cap as a "best" to move to)."""
    if p.get("recommended_bucket_cap_mb") is None:
        return f"nothing about bucket_cap_mb: {p.get('bucket_cap_verdict') or 'no cap is predicted to help'}", ""
    cap = cap_text(p["recommended_bucket_cap_mb"])
    saving = p["measured_step_ms"] - p["bucket_cap_step_ms"]
    larger = p["recommended_bucket_cap_mb"] > p["current_bucket_cap_mb"]
    why = "fewer all-reduces, each with its fixed cost"
    if not larger:
        why = "all-reduces that start earlier, while backward runs"
    trust = f"the replay reproduces this run's step within {p['calibration_error_pct']:.0f}%"
    return (
        f"with bucket_cap_mb={cap} about {p['bucket_cap_step_ms']:.1f} ms ({saving:.1f} ms saved: {why}; "
        f"{p['confidence']} confidence, {trust})",
        f"{why[0].upper()}{why[1:]}: DistributedDataParallel(net, bucket_cap_mb={cap}).",
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
