"""The checks of one attached DDP instance: started together at attach, stopped at detach.

A rewrap (``Monitor.reattach``) stops the old instance's and starts the new one's; the monitor
keeps what carries over (a rank's first non-finite step is said once per log).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddpdoctor.events import Record
from ddpdoctor.runtime import torch_compat
from ddpdoctor.runtime.checks.nonfinite import NonFiniteWatch
from ddpdoctor.runtime.checks.sampled import SampledChecks
from ddpdoctor.runtime.checks.unsynced import UnsyncedUpdates


def start_checks(
    ddp: Any,
    attachment: Any,
    extension: Any,
    rank: int,
    ddp_index: int,
    check_every: int,
    emit: Callable[[Record], None],
    failed: Callable[[str, BaseException], None],
    reported: bool,
) -> tuple[SampledChecks, NonFiniteWatch, UnsyncedUpdates]:
    """The sampled checks, the non-finite watch and the unsynced-update watch of ``ddp``, just
    attached (``attachment``: its header, its native side, its all-reduce's exactness).

    ``extension``: the native extension where it loaded (its one-call checks; None: Python's).
    ``reported``: this log already said the rank's first non-finite step.
    """
    # each rank's own gradients, looked at before the all-reduce (the native route: in the
    # scaling pass, one word read a forward; the Python route: in its comm hook)
    nonfinite = NonFiniteWatch(ddp, rank)
    native = attachment.native
    if reported:
        nonfinite.reported = True
    elif native is not None and native.scale is not None:
        nonfinite.watch_native(native.scale)
    checks = SampledChecks(
        ddp,
        attachment.header,
        check_every,
        emit,
        rank,
        ddp_index,
        same_flags=getattr(extension, "same_requires_grad", None),
        param_sample=getattr(extension, "ParamSample", None),
        tensor_values=getattr(extension, "tensor_values", None),
        failed=failed,
    )
    if native is not None:
        checks.compiled_possible = native.compiled_possible
    checks.exact_scaling = attachment.exact_scaling
    return checks, nonfinite, UnsyncedUpdates(checks.params, checks.reduced, rank)


def stop_checks(checks: SampledChecks | None, nonfinite: NonFiniteWatch | None) -> None:
    """Detach: a sample in progress ends (its hooks go), nothing more is looked at."""
    if nonfinite is not None:
        nonfinite.stop()
    if checks is not None:
        checks.end_sample()
        checks.stop()
        checks.compiled_possible = torch_compat.compiled_autograd_possible
