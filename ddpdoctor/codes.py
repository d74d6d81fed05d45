"""The finding codes: each declared once, with its family, default severity, title, reference
anchor and where it is raised.

Every place that needs to know a code reads it here: the warning category a live finding is
raised in (``runtime.checks.live_findings``), how the report merges findings (``analysis.diagnose``) and
the findings reference in the docs. A new finding is its detector plus one entry below;
``tests/test_codes.py`` fails when a detector produces a code that is not declared here, or when a
code declared here is produced nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ddpdoctor.categories import (
    AccumulationWarning,
    BufferWarning,
    DDPDoctorWarning,
    HangWarning,
    NonFiniteGradientWarning,
    NotSynchronizedWarning,
    PerformanceWarning,
    ReplicaDivergenceWarning,
    StaleRequiresGradWarning,
    UnusedParametersWarning,
)

#: Where a code is raised: in the training script (a Python warning and a ``finding`` record),
#: in ``ddpdoctor watch`` (every rank's records meet there), and by ``ddpdoctor report`` (the logs).
Where = Literal["script", "watch", "report"]
Severity = Literal["info", "warning", "error"]

#: The findings reference, where each code has an entry whose anchor is the code itself.
REFERENCE = "reference/findings.md"


@dataclass(frozen=True)
class Code:
    """One finding code, as the project documents it."""

    name: str
    category: type[DDPDoctorWarning]
    #: the worst severity it is raised with (a code may be raised milder where its evidence is weaker)
    severity: Severity
    title: str
    raised: frozenset[Where]
    #: each rank's finding tells of that rank's own cost: kept one per rank, never merged
    per_rank: bool = False
    #: a rank may log it from evidence that is not in its log (``check_replicas``): the report
    #: keeps the logged finding where its own detectors do not find it again
    logged_evidence: bool = False

    @property
    def anchor(self) -> str:
        """The code's entry in the findings reference, relative to the docs' root."""
        return f"{REFERENCE}#{self.name}"


def _code(
    name: str,
    category: type[DDPDoctorWarning],
    severity: Severity,
    title: str,
    raised: str,
    *,
    per_rank: bool = False,
    logged_evidence: bool = False,
) -> Code:
    where = frozenset(raised.split())
    assert where <= {"script", "watch", "report"}, where
    return Code(name, category, severity, title, where, per_rank, logged_evidence)  # type: ignore[arg-type]


CODES: dict[str, Code] = {
    c.name: c
    for c in (
        _code(
            "frozen-after-wrap",
            StaleRequiresGradWarning,
            "error",
            "Parameters frozen after DDP was built",
            "script watch report",
        ),
        _code(
            "unfrozen-after-wrap",
            StaleRequiresGradWarning,
            "error",
            "Parameters unfrozen after DDP was built: their gradients are never synchronized",
            "script watch report",
        ),
        _code(
            "replica-divergence",
            ReplicaDivergenceWarning,
            "error",
            "Parameters differ across ranks",
            "script watch report",
            logged_evidence=True,
        ),
        _code(
            "buffer-divergence",
            ReplicaDivergenceWarning,
            "warning",
            "Buffers differ across ranks",
            "script watch report",
            logged_evidence=True,
        ),
        _code(
            "constant-buffers",
            BufferWarning,
            "warning",
            "Buffers that never change are broadcast at every forward",
            "script watch report",
        ),
        _code(
            "buffer-broadcast-cost",
            BufferWarning,
            "warning",
            "The buffer broadcast is a large share of the step",
            "script watch report",
        ),
        _code(
            "unused-parameters",
            UnusedParametersWarning,
            "error",
            "Parameters that get no gradient",
            "script watch report",
        ),
        _code(
            "find-unused-unneeded",
            UnusedParametersWarning,
            "warning",
            "find_unused_parameters=True with nothing unused",
            "script watch report",
        ),
        _code(
            "sync-during-accumulation",
            AccumulationWarning,
            "warning",
            "Gradient accumulation synchronizes at every micro-step",
            "script watch report",
        ),
        _code(
            "non-finite-gradient",
            NonFiniteGradientWarning,
            "error",
            "A NaN or Inf gradient, named at the rank and step it came from",
            "script watch report",
        ),
        _code(
            "param-not-reduced",
            NotSynchronizedWarning,
            "error",
            "Parameters that train but DDP does not all-reduce",
            "script watch report",
        ),
        _code(
            "gradients-never-synchronized",
            NotSynchronizedWarning,
            "error",
            "Optimizer steps with no all-reduce behind them",
            "script watch report",
            logged_evidence=True,
        ),
        _code("straggler", PerformanceWarning, "warning", "A rank the others wait for", "watch report", per_rank=True),
        _code(
            "exposed-communication",
            PerformanceWarning,
            "warning",
            "Communication the backward does not hide",
            "report",
        ),
        _code("bucket-size", PerformanceWarning, "warning", "A bucket_cap_mb predicted to be faster", "watch report"),
        _code("hang", HangWarning, "error", "Ranks stopped making progress", "script watch report"),
        _code("rank-lost", HangWarning, "error", "A rank's log ends without an end", "watch report"),
        _code(
            "mismatched-collectives",
            HangWarning,
            "error",
            "Ranks ran different collectives at the same step",
            "watch report",
        ),
    )
}


def category_of(code: str) -> type[DDPDoctorWarning]:
    """The warning category a finding of ``code`` is raised in (the base category for a code
    this version does not know: a newer rank's log read by an older reader)."""
    known = CODES.get(code)
    return known.category if known is not None else DDPDoctorWarning


#: Codes whose findings are kept one per rank.
PER_RANK_CODES = frozenset(c.name for c in CODES.values() if c.per_rank)
#: Codes a rank may log from evidence outside its log.
LOGGED_EVIDENCE_CODES = frozenset(c.name for c in CODES.values() if c.logged_evidence)
