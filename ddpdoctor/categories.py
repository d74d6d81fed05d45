"""ddpdoctor's warning categories, one per family, so users filter them the standard way.

warnings.filterwarnings("ignore", category=ddpdoctor.BufferWarning)
warnings.filterwarnings("error", category=ddpdoctor.StaleRequiresGradWarning)
"""

from __future__ import annotations


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


class HangWarning(DDPDoctorWarning):
    """No progress: a hang or a lost rank."""


#: The warning category of each finding code (the codes are DESIGN.md's contract).
CATEGORY_OF_CODE: dict[str, type[DDPDoctorWarning]] = {
    "frozen-after-wrap": StaleRequiresGradWarning,
    "unfrozen-after-wrap": StaleRequiresGradWarning,
    "replica-divergence": ReplicaDivergenceWarning,
    "buffer-divergence": ReplicaDivergenceWarning,
    "constant-buffers": BufferWarning,
    "buffer-broadcast-cost": BufferWarning,
    "unused-parameters": UnusedParametersWarning,
    "find-unused-unneeded": UnusedParametersWarning,
    "sync-during-accumulation": AccumulationWarning,
    "straggler": PerformanceWarning,
    "exposed-communication": PerformanceWarning,
    "bucket-size": PerformanceWarning,
    "hang": HangWarning,
    "rank-lost": HangWarning,
}

__all__ = [
    "CATEGORY_OF_CODE",
    "AccumulationWarning",
    "BufferWarning",
    "CommHookWarning",
    "DDPDoctorWarning",
    "HangWarning",
    "LogWriteWarning",
    "PerformanceWarning",
    "ProbeDisabledWarning",
    "ReplicaDivergenceWarning",
    "StaleRequiresGradWarning",
    "UnusedParametersWarning",
]
