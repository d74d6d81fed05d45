"""ddpdoctor's warning categories, one per family, so users filter them the standard way.

warnings.filterwarnings("ignore", category=ddpdoctor.BufferWarning)
warnings.filterwarnings("error", category=ddpdoctor.StaleRequiresGradWarning)

Every warning of ddpdoctor's goes through ``warn``: a filter that turns warnings into errors
for the script's own sake (``python -W error``, ``PYTHONWARNINGS=error::UserWarning``, a test
runner's ``filterwarnings = error``) never makes one of them an exception inside training; a
filter that names a ddpdoctor category asks for exactly that, and gets it where it is safe.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings


class DDPDoctorWarning(UserWarning):
    """Base class of every warning ddpdoctor raises."""


class ProbeDisabledWarning(DDPDoctorWarning):
    """One of ddpdoctor's own probes failed and was switched off; training is unaffected."""


class LogWriteWarning(DDPDoctorWarning):
    """The run log could not be opened or written; training is unaffected."""


class CommHookWarning(DDPDoctorWarning):
    """A communication hook could not be wrapped for timing; bucket timing is off."""


class StaleRequiresGradWarning(DDPDoctorWarning):
    """requires_grad changed after DDP was built (frozen-after-wrap, unfrozen-after-wrap)."""


class ReplicaDivergenceWarning(DDPDoctorWarning):
    """Parameters or buffers differ across ranks."""


class BufferWarning(DDPDoctorWarning):
    """Buffer broadcast problems: constant buffers, broadcast cost."""


class UnusedParametersWarning(DDPDoctorWarning):
    """Unused parameters, or find_unused_parameters=True with nothing unused."""


class AccumulationWarning(DDPDoctorWarning):
    """Gradient accumulation that synchronizes at every micro-step."""


class PerformanceWarning(DDPDoctorWarning):
    """Stragglers, exposed communication, bucket size."""


class NonFiniteGradientWarning(DDPDoctorWarning):
    """A rank's own gradient was NaN or infinite before the all-reduce (non-finite-gradient)."""


class NotSynchronizedWarning(DDPDoctorWarning):
    """Training that DDP does not synchronize: a parameter it does not reduce (param-not-reduced),
    optimizer steps with no all-reduce behind them (gradients-never-synchronized)."""


class HangWarning(DDPDoctorWarning):
    """No progress: a hang or a lost rank."""


def _asked_for_error(category: type[Warning]) -> bool:
    """Whether an "error" filter names a ddpdoctor category that ``category`` falls under (not a
    blanket one: ``Warning``, ``UserWarning``)."""
    return any(
        action == "error"
        and isinstance(named, type)
        and issubclass(named, DDPDoctorWarning)
        and issubclass(category, named)
        for action, _message, named, _module, _line in warnings.filters
    )


def warn(message: str, category: type[Warning], stacklevel: int = 1) -> Warning | None:
    """``warnings.warn`` for ddpdoctor: shown, ignored or counted as the filters say, but never
    raised here. Where a filter makes it an error, it is written on stderr in the usual format
    instead; where the user named its ddpdoctor category in an "error" filter (on the main
    thread), the exception is returned instead, for the caller to raise where training can take
    it (the monitor's next forward). ``stacklevel`` counts from the caller, as ``warnings.warn``'s does."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
        return None
    except Warning as exc:
        if _asked_for_error(category) and threading.current_thread() is threading.main_thread():
            return exc
        try:
            frame = sys._getframe(stacklevel)
            where = (frame.f_code.co_filename, frame.f_lineno)
        except ValueError:  # fewer frames than the stack level
            where = ("sys", 1)
        with contextlib.suppress(Exception):  # a closed stderr must not break training either
            sys.stderr.write(warnings.formatwarning(message, category, *where))
        return None


__all__ = [
    "AccumulationWarning",
    "BufferWarning",
    "CommHookWarning",
    "DDPDoctorWarning",
    "HangWarning",
    "LogWriteWarning",
    "NonFiniteGradientWarning",
    "NotSynchronizedWarning",
    "PerformanceWarning",
    "ProbeDisabledWarning",
    "ReplicaDivergenceWarning",
    "StaleRequiresGradWarning",
    "UnusedParametersWarning",
    "warn",
]
