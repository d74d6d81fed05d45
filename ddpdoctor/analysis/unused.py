"""unused-parameters and find-unused-unneeded, from the sampled gradient checks."""

from __future__ import annotations

from statistics import median

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.sizes import first_seen, human_bytes, name_list, param_bytes
from ddpdoctor.events import Header, Step, Unused

#: Sampled steps without any unused parameter before find_unused_parameters=True is called needless.
MIN_CLEAN_SAMPLES = 3


def unused_parameters(header: Header, samples: list[Unused], steps: list[Step], rank: int,
                      frozen: bool = False) -> list[Finding]:
    """Findings from one rank's sampled unused-parameter checks (``frozen``: some parameter DDP
    reduces has lost requires_grad, which find_unused_parameters=True is then needed for)."""
    if not samples:
        return []
    find_unused = bool(header.ddp_options.get("find_unused_parameters"))
    names, first = first_seen(samples, "names")
    if names:
        nbytes = param_bytes(header, names)
        if find_unused:
            # never used in any sample: dead weight; used in some: conditional branches, DDP copes
            never = [n for n in names if all(n in s.names for s in samples)]
            return [Finding(
                code="unused-parameters", severity="warning" if never and len(samples) >= 2 else "info",
                ranks=[rank], step=first,
                title=f"{len(names)} parameter(s) produced no gradient",
                detail=(f"{name_list(names)} received no gradient in sampled steps"
                        f"{f' ({name_list(never)} in none of the {len(samples)} samples)' if never else ''}. "
                        "find_unused_parameters=True handles it, at the cost of a graph search every step; "
                        f"their {human_bytes(nbytes)} are still all-reduced (as zeros) unless unused on every rank."),
                evidence={"names": names, "never_used": never, "bytes_per_step": nbytes, "samples": len(samples)},
                fix=("If they are never used, delete them from the model (or wrap only the used part). If they are "
                     "used on some steps only, keep find_unused_parameters=True."),
            )]
        return [Finding(
            code="unused-parameters", severity="error", ranks=[rank], step=first,
            title=f"{len(names)} parameter(s) produced no gradient with find_unused_parameters=False",
            detail=(f"{name_list(names)} received no gradient at step {first}. DDP waits for every gradient it "
                    "reduces, so the next iteration fails with 'Expected to have finished reduction in the prior "
                    "iteration'."),
            evidence={"names": names, "bytes_per_step": nbytes},
            fix=("Use every parameter in the forward, or build DDP with find_unused_parameters=True:\n"
                 "    model = DistributedDataParallel(net, find_unused_parameters=True)"),
        )]
    if not find_unused or frozen or len(samples) < MIN_CLEAN_SAMPLES:
        return []
    post = [s.post_forward_us for s in samples if s.post_forward_us is not None]
    step_us = [s.end_us for s in steps if s.end_us is not None]
    cost_ms = median(post) / 1000.0 if post else None
    share = (median(post) / median(step_us)) if post and step_us else None
    severity = "warning" if share is not None and share >= 0.01 else "info"
    return [Finding(
        code="find-unused-unneeded", severity=severity, ranks=[rank], step=samples[0].step,
        title="find_unused_parameters=True, but every parameter gets a gradient",
        detail=(f"In {len(samples)} sampled steps no parameter was unused. The flag makes DDP search the autograd "
                f"graph after every forward{f' ({cost_ms:.2f} ms per step, {share:.1%} of the step)' if share is not None else ''}"
                " and all-reduce a usage bitmap: pure overhead here."),
        evidence={"samples": len(samples), "post_forward_ms": cost_ms, "share_of_step": share},
        fix="model = DistributedDataParallel(net, find_unused_parameters=False)  # the default",
    )]
