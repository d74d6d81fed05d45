"""param-not-reduced: a parameter trains, but DDP does not all-reduce it.

DDP decides in its constructor which tensors it all-reduces, and holds them. A parameter assigned
after that (``ddp.module.fc.weight = nn.Parameter(w)``, a classifier head reassigned for a
fine-tuning stage, a parameter or submodule added) is a tensor DDP does not hold: each rank updates
it with its own gradient and the replicas drift apart in silence. DDP still reduces the old tensor,
now orphaned: it gets no gradient (with ``find_unused_parameters=True`` DDP all-reduces zeros for
it; without, DDP's next iteration fails waiting for it). The runtime's sentinel logs the names in
``grad_flags`` records (``replaced``, ``added``) from the step they appear, before any drift.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpdoctor.analysis.evidence import FlagEvidence
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.sizes import name_list
from ddpdoctor.events import GradFlags, Header

CODE = "param-not-reduced"

FIX = (
    "Replace or add parameters before wrapping the model in DDP, or rebuild DDP after the change (same options, "
    "the optimizer must hold the new tensors):\n"
    "    model = ddpdoctor.rewrap(model)\n"
    "    optimizer = torch.optim.SGD(model.parameters(), ...)  # the optimizer you had, over the new parameters\n"
    "or by hand: model = DistributedDataParallel(model.module, <same options>). To load new weights into an "
    "existing parameter, copy them in place instead: with torch.no_grad(): model.module.fc.weight.copy_(w)"
)


def orphaned(evidence: FlagEvidence) -> list[str]:
    """Names whose tensor DDP reduces is no longer the module's (the old tensor of a replacement):
    it gets no gradient, and is not an unused parameter to delete."""
    return list(evidence.replaced.names)


def params_not_reduced(header: Header, flags: Sequence[GradFlags] | FlagEvidence, rank: int) -> list[Finding]:
    """The finding of one rank's ``grad_flags`` records under ``header`` (records, or their running
    ``FlagEvidence``)."""
    evidence = flags if isinstance(flags, FlagEvidence) else FlagEvidence.of(flags)
    replaced, added = list(evidence.replaced.names), list(evidence.added.names)
    if not (replaced or added):
        return []
    firsts = [s for s in (evidence.replaced.first, evidence.added.first) if s is not None]
    step = min(firsts) if firsts else None
    names = replaced + added
    find_unused = bool(header.ddp_options.get("find_unused_parameters"))
    causes = []
    if replaced:
        causes.append(
            f"{name_list(replaced)} {'was' if len(replaced) == 1 else 'were'} replaced after DDP was built (a new "
            "nn.Parameter assigned, or the submodule holding it reassigned): DDP still all-reduces the old "
            "tensor, now orphaned"
            + (
                ", which gets no gradient (find_unused_parameters=True all-reduces zeros for it: it is not an "
                "unused parameter to delete)"
                if find_unused
                else ", and waits for its gradient, which never comes: the next iteration fails with 'Expected to "
                "have finished reduction in the prior iteration'. This replacement is the real cause of that error"
            )
        )
    if added:
        causes.append(f"{name_list(added)} {'was' if len(added) == 1 else 'were'} added after DDP was built")
    return [
        Finding(
            code=CODE,
            severity="error",
            ranks=[rank],
            step=step,
            title=f"{len(names)} parameter(s) train but DDP does not all-reduce them",
            detail=(
                f"Since step {step}: " + "; ".join(causes) + ". Each rank updates the new tensor"
                f"{'s' if len(names) > 1 else ''} with its own local gradient: the replicas drift apart silently "
                "(the replica check confirms it once they have)."
            ),
            evidence={"names": names, "replaced": replaced, "added": added, "find_unused_parameters": find_unused},
            fix=FIX,
        )
    ]
