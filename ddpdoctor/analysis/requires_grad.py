"""frozen-after-wrap and unfrozen-after-wrap: requires_grad changed after DDP was built."""

from __future__ import annotations

from collections.abc import Sequence

from ddpdoctor.analysis.evidence import FlagEvidence
from ddpdoctor.analysis.findings import Finding, Severity
from ddpdoctor.analysis.sizes import counted, human_bytes, name_list, param_bytes
from ddpdoctor.events import GradFlags, Header

REWRAP_FIX = (
    "Rebuild DDP after changing requires_grad (same options, the optimizer keeps working):\n"
    "    model = ddpdoctor.rewrap(model)\n"
    "or by hand: model = DistributedDataParallel(model.module, <same options>)"
)


def stale_requires_grad(header: Header, flags: Sequence[GradFlags] | FlagEvidence, rank: int) -> list[Finding]:
    """Findings from the requires_grad changes one rank logged under ``header`` (``flags``: the
    records, or the running ``FlagEvidence`` of them)."""
    evidence = flags if isinstance(flags, FlagEvidence) else FlagEvidence.of(flags)
    out = []
    frozen, frozen_step = list(evidence.frozen.names), evidence.frozen.first
    if frozen:
        nbytes = param_bytes(header, frozen)
        find_unused = bool(header.ddp_options.get("find_unused_parameters"))
        severity: Severity
        if find_unused:
            severity, consequence = (
                "warning",
                (f"DDP still all-reduces their gradients as zeros: {human_bytes(nbytes)} sent for nothing every step."),
            )
        else:
            severity, consequence = (
                "error",
                (
                    "With find_unused_parameters=False DDP waits for gradients that never come: the next iteration "
                    "fails with 'Expected to have finished reduction in the prior iteration before starting a new "
                    "one'. This change of requires_grad is the real cause of that error."
                ),
            )
        out.append(
            Finding(
                code="frozen-after-wrap",
                severity=severity,
                ranks=[rank],
                step=frozen_step,
                title=f"{counted(len(frozen), 'parameter')} frozen after DDP was built",
                detail=(
                    f"{name_list(frozen)} had requires_grad=True when DDP was built and False since step "
                    f"{frozen_step}. DDP decides once, in its constructor, which gradients it reduces. {consequence}"
                ),
                evidence={"names": frozen, "bytes_per_step": nbytes, "find_unused_parameters": find_unused},
                fix=REWRAP_FIX,
            )
        )
    unfrozen, unfrozen_step = list(evidence.unfrozen.names), evidence.unfrozen.first
    if unfrozen:
        nbytes = param_bytes(header, unfrozen)
        out.append(
            Finding(
                code="unfrozen-after-wrap",
                severity="error",
                ranks=[rank],
                step=unfrozen_step,
                title=(
                    f"{counted(len(unfrozen), 'parameter')} unfrozen after DDP was built: gradients never synchronized"
                ),
                detail=(
                    f"{name_list(unfrozen)} gained requires_grad=True at step {unfrozen_step}, after DDP was built "
                    "without them. Each rank now updates them with its own local gradient: the replicas drift "
                    "apart silently (the replica check confirms it)."
                ),
                evidence={"names": unfrozen, "bytes_per_step_not_synchronized": nbytes},
                fix=REWRAP_FIX,
            )
        )
    return out
