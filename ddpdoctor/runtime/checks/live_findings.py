"""Findings raised live on a rank: the analysis' detectors over this rank's own records.

What a rank keeps is bounded: the last WINDOW steps, and for the sampled records (grad flags,
unused parameters, fingerprints) the running evidence of ``analysis.evidence``, fed one record
at a time; a check reads it at a cost that does not grow with the run.

Each distinct problem is warned once (a ``DDPDoctorWarning`` subclass per family), written to
the log as a ``finding`` record, and, when it is an error that is about to kill training, flushed
to disk at once so that the log and stderr already say why when DDP raises.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Callable
from types import FrameType

import torch

from ddpdoctor.analysis.accumulation import sync_during_accumulation
from ddpdoctor.analysis.buffers import TransferMemo, buffer_broadcast_cost, constant_buffers
from ddpdoctor.analysis.evidence import BufferEvidence, FlagEvidence, UnusedEvidence
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.reduction import orphaned, params_not_reduced
from ddpdoctor.analysis.requires_grad import stale_requires_grad
from ddpdoctor.analysis.unused import unused_parameters
from ddpdoctor.categories import warn
from ddpdoctor.codes import category_of
from ddpdoctor.events import (
    FindingRecord,
    Fingerprint,
    GradFlags,
    Header,
    Record,
    Step,
    Unused,
)

#: Step-based checks run every this many steps, over at most the last WINDOW steps.
EVERY = 50
WINDOW = 100
#: Steps before the step-based checks first run (medians need a few).
WARMUP = 20
#: Findings kept in ``raised`` (the most recent; each is also in the log).
RAISED_KEPT = 256
#: Cost findings whose warning waits for a second check (EVERY steps later, or the monitor's
#: clean close) to find it again: the first check's window is the job's start-up, whose first
#: collectives (and a loaded host) made a 2 KiB broadcast look like 19% of the step on a real job
#: where the whole run said 6%. Until confirmed, such a warning is neither logged nor said.
CONFIRMED_CODES = frozenset({"buffer-broadcast-cost"})
#: ``LiveFindings._seen``'s key of the buffer-broadcast-cost warning (the finding names nothing)
_BCAST_WARNED = ("buffer-broadcast-cost", "warning", ())


#: Frames a warning is not attributed to: ddpdoctor's own and torch's (a forward hook runs
#: inside torch's module call), so that it points at the line of the script that ran the step.
_NOT_THE_SCRIPT = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def _script_stacklevel() -> int:
    """``stacklevel`` for ``warn`` called in ``warn_finding``: the first frame outside
    ddpdoctor and torch (1, warn_finding itself, where there is none: a thread of ddpdoctor's)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_THE_SCRIPT):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1


def warn_finding(finding: Finding, rank: int) -> Warning | None:
    """The Python warning for a finding, in its family's category, attributed to the script's
    line that was running (a forward, ``check_replicas``), not to ddpdoctor's code. Never raised
    here: where the user's filter names its category as an error, the exception is returned for
    the caller to raise where training can take it (``categories.warn``)."""
    category = category_of(finding.code)
    step = f" (step {finding.step})" if finding.step is not None else ""
    return warn(
        f"ddpdoctor [rank {rank}] {finding.code}: {finding.title}{step}. {finding.detail}\nFix: {finding.fix}",
        category,
        stacklevel=_script_stacklevel(),
    )


class LiveFindings:
    """Watches the records one monitor emits and raises what they show."""

    def __init__(self, rank: int, ddp_index: int, emit: Callable[[Record], None], flush: Callable[[], None]) -> None:
        self.rank = rank
        self.ddp_index = ddp_index
        self._emit = emit
        self._flush = flush
        self.header: Header | None = None
        self.steps: deque[Step] = deque(maxlen=WINDOW)
        # running evidence of the current DDP instance: bounded by the model, not by the run
        self.flags = FlagEvidence()
        self.unused = UnusedEvidence()
        self.prints: BufferEvidence | None = None
        self.raised: deque[Finding] = deque(maxlen=RAISED_KEPT)
        # keys of findings raised: per code, names only grow (unused) or shrink (constant buffers)
        # with the model's own parameters, so this is bounded by the model too
        self._seen: set[tuple[str, str, tuple[str, ...]]] = set()
        #: a finding's warning that the user's filter made an error (a filter naming its
        #: ddpdoctor category): raised by the monitor at its next forward, out of the training
        #: step's own call, never from inside ddpdoctor's probes or threads
        self.error: Warning | None = None
        self._since_check = 0
        self._checked = False
        #: codes of CONFIRMED_CODES that the last check found as a warning, not yet raised
        self._held: set[str] = set()
        # Step records observed, and the last of them (by that count; 0: none) with a buffer
        # broadcast, and with synchronized buckets but no optimizer step
        self._observed = 0
        self._last_bcast = 0
        self._last_unstepped = 0
        # the window's steps' all-reduce bounds, each worked out at the first check that reads it
        self._transfers = TransferMemo(2 * WINDOW)

    def observe_steps(self, records: list[Step] | tuple[Step, ...]) -> None:
        """Step records, oldest first (the batched emission's): each checked as ``observe``
        would, the window as of that step. Taken in runs up to the next check's step (this runs
        for every step record, on the training thread: a run costs a few operations, not a few
        per record)."""
        window = self.steps
        n = len(records)
        done = 0
        due = EVERY if self._checked else WARMUP  # first at WARMUP steps (a short job still hears it)
        while done < n:
            take = min(n - done, max(1, due - self._since_check))
            run = records if take == n else records[done : done + take]
            window.extend(run)
            base = self._observed
            # what the step-based checks look for: the last step of the run with a buffer
            # broadcast, and with synchronized buckets but no optimizer step (none of either in
            # the window: the check finds nothing)
            for k in range(take - 1, -1, -1):
                if run[k].bcast_us is not None:
                    self._last_bcast = base + k + 1
                    break
            for k in range(take - 1, -1, -1):
                record = run[k]
                if record.opt_start_us is None and record.b_ready_us:
                    self._last_unstepped = base + k + 1
                    break
            self._observed = base + take
            self._since_check += take
            done += take
            if self._since_check >= due:  # then every EVERY steps
                self._since_check = 0
                self._checked, due = True, EVERY
                self._check_steps()

    def observe(self, record: Record) -> None:
        """One record the monitor emitted."""
        if isinstance(record, Step):
            self.observe_steps((record,))
        elif isinstance(record, GradFlags) and self.header is not None:
            self.flags.add(record)
            self.raise_findings(stale_requires_grad(self.header, self.flags, self.rank))
            self.raise_findings(params_not_reduced(self.header, self.flags, self.rank))
        elif isinstance(record, Unused) and self.header is not None:
            self.unused.add(record)
            self.raise_findings(
                unused_parameters(
                    self.header,
                    self.unused,
                    list(self.steps),
                    self.rank,
                    self.flags.any_frozen,
                    orphaned=orphaned(self.flags),
                )
            )
        elif isinstance(record, Fingerprint) and self.prints is not None and self.header is not None:
            if self.header.buffers:  # (what the check reads: none for a model without buffers)
                self.prints.add(record)
                self.raise_findings(constant_buffers(self.header, self.prints, list(self.steps), self.rank))
        elif isinstance(record, Header):
            # a new DDP instance (rewrap): what was stale about the old one no longer applies
            self.header = record
            self.flags, self.unused, self.prints = FlagEvidence(), UnusedEvidence(), BufferEvidence(record)
            self._held = set()
            self.steps.clear()  # the last-seen counts now fall before the window: nothing to reset
            self._transfers = TransferMemo(2 * WINDOW)  # (its steps are the old instance's)

    def _check_steps(self) -> None:
        """The step-based detectors over the window, each only when the window holds what it
        looks for (it would find nothing otherwise): a step with a buffer broadcast for
        ``buffer-broadcast-cost``; a synchronized step that no optimizer step followed for
        ``sync-during-accumulation`` (an accumulation cycle has one). A run without buffer
        broadcasts or accumulation then pays two comparisons a check, not two passes over the
        window; what is found, and when, is unchanged."""
        first = self._observed - len(self.steps)  # steps after this one are in the window
        # once its warning is raised, nothing more of buffer-broadcast-cost can be: the check
        # (about 160 µs of the training thread's every EVERY steps on a 2-core host) is not run again
        bcast = self._last_bcast > first and self.header is not None and _BCAST_WARNED not in self._seen
        accumulating = self._last_unstepped > first
        if not (bcast or accumulating):
            return
        steps = list(self.steps)
        if bcast and self.header is not None:
            self.raise_findings(
                self._confirmed(buffer_broadcast_cost(self.header, steps, self.rank, memo=self._transfers))
            )
        if accumulating:
            self.raise_findings(sync_during_accumulation(steps, self.rank))

    def _confirmed(self, findings: list[Finding]) -> list[Finding]:
        """What of ``findings`` to raise now: a warning of CONFIRMED_CODES only when the check
        before found it as a warning too (else it is held); anything else at once."""
        now = {f.code for f in findings if f.code in CONFIRMED_CODES and f.severity == "warning"}
        out = [f for f in findings if f.code not in now or f.code in self._held]
        self._held = now
        return out

    def finish(self) -> None:
        """At a clean close: a held warning is checked once more over the window, which now holds
        every step since (a job shorter than two checks still hears it, from the whole run)."""
        if "buffer-broadcast-cost" in self._held and self.header is not None:
            self.raise_findings(buffer_broadcast_cost(self.header, list(self.steps), self.rank, memo=self._transfers))
        self._held = set()

    def raise_findings(self, findings: list[Finding]) -> None:
        """Log and warn each finding not raised before."""
        for f in findings:
            key = (f.code, f.severity, tuple(f.evidence.get("names", ()) or ()))
            if key in self._seen:
                continue
            self._seen.add(key)
            self.raised.append(f)
            self._emit(
                FindingRecord(
                    rank=self.rank,
                    ddp=self.ddp_index,
                    step=f.step,
                    code=f.code,
                    severity=f.severity,
                    title=f.title,
                    detail=f.detail,
                    fix=f.fix,
                    ranks=f.ranks,
                    evidence=f.evidence,
                )
            )
            if f.severity == "info":
                continue
            if f.severity == "error":
                self._flush()  # on disk before the error it predicts kills the process
            error = warn_finding(f, self.rank)
            if error is not None and self.error is None:
                self.error = error  # the user asked for it as an exception: the monitor raises it
