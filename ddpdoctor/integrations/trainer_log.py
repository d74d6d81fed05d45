"""What the Lightning and transformers callbacks share: attaching once, rank 0's reading, the names.

Every rank attaches ddpdoctor to the trainer's ``DistributedDataParallel`` unless something already
did (``ddpdoctor run``'s zero-code hook, an explicit ``ddpdoctor.instrument``): that monitor is
used as it is, and left to whoever attached it. Rank 0 then reads the run dir the ranks write
(``follow.RunFollower``, on a thread of its own) and hands the callback, at its logging steps,
the metrics to give the trainer's loggers and the new findings to log.

Metric names: ``ddpdoctor/<figure>/rank_<r>`` per rank (``figures.RANK_FIGURES``), and
``ddpdoctor/run/<figure>`` per run (``figures.RUN_FIGURES``), logged at ddpdoctor's step index
(the synchronized step, counted from 0).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.integrations.figures import StepFigures
from ddpdoctor.integrations.follow import RunFollower, Update
from ddpdoctor.integrations.tensorboard_export import finding_markdown
from ddpdoctor.runtime.config import Options

#: Default interval, in trainer steps, between two rounds of logging on rank 0.
EVERY_N_STEPS = 50
#: At the end of training, how long rank 0 waits for the other ranks to close the logs it attached
#: (they close them at the same point of their own training loop), so that their last steps show.
FINISH_WAIT_S = 5.0
FINISH_POLL_S = 0.1
#: Findings not taken from the last read: the ranks close their logs one after another at the end
#: of training, and a rank that has not closed its log yet while another has is no lost rank.
NOT_AT_FINISH = frozenset({"rank-lost"})
#: Name of the text series (TensorBoard) or the logged string (W&B) that holds the findings.
FINDINGS_KEY = "ddpdoctor/findings"
#: The running count of findings (every logger takes a number, a CSV file too).
FINDINGS_COUNT_KEY = "ddpdoctor/run/findings"


def metrics_of(sf: StepFigures) -> dict[str, float]:
    """One step's figures under the names the trainers' loggers get."""
    out = {
        f"ddpdoctor/{name}/rank_{rank}": v for rank, figures in sorted(sf.ranks.items()) for name, v in figures.items()
    }
    out.update({f"ddpdoctor/run/{name}": v for name, v in sf.run.items()})
    return out


def finding_line(f: Finding) -> str:
    """One finding on one line, for the trainer's text log."""
    ranks = f" ranks {f.ranks}" if f.ranks else ""
    at = f" from step {f.step}" if f.step is not None else ""
    return f"ddpdoctor [{f.severity}] {f.code}: {f.title}{ranks}{at}"


def log_finding(log: Any, f: Finding) -> None:
    """A finding in the trainer's own log (``log``: a ``logging.Logger``, or transformers' own
    kind of it): a warning or an error at those severities, else info."""
    level = {"error": logging.ERROR, "warning": logging.WARNING}.get(f.severity, logging.INFO)
    log.log(level, finding_line(f))


class TrainerWatch:
    """One rank's side of a trainer callback: ``attach`` at the start of training, ``due`` and
    ``take`` at each step (rank 0 only reads), ``finish`` at its end."""

    def __init__(self, every_n_steps: int = EVERY_N_STEPS, options: dict[str, Any] | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be 1 or more (got {every_n_steps})")
        self.every_n_steps = every_n_steps
        self.options = Options.of(**(options or {}))  # a mistyped option is the caller's error: raised now
        self.monitor: Any = None
        self.attached_here = False  # this callback attached the monitor (and closes it)
        self.follower: RunFollower | None = None
        self.findings_seen = 0
        self.why_not: str | None = None  # why there is nothing to log (said once)
        self._last_due = 0
        self._error_said = False
        self._final_error: BaseException | None = None  # the reader's error once it stopped

    def attach(self, ddp: Any, rank: int) -> None:
        """Attach to ``ddp`` unless a monitor is on it already; rank 0 starts reading the run dir."""
        import torch

        from ddpdoctor.runtime.attach import monitor_of
        from ddpdoctor.runtime.monitor import instrument

        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            kind = type(ddp).__name__
            self.why_not = f"the trained model is a {kind}, not a DistributedDataParallel: nothing to watch"
            return
        monitor = monitor_of(ddp)
        if monitor is None:
            monitor = instrument(ddp, options=self.options)
            if not hasattr(monitor, "ddp"):  # the do-nothing monitor: instrument warned why
                self.why_not = "ddpdoctor could not attach to the model (see the warning above)"
                return
            self.attached_here = True
        self.monitor = monitor
        if rank != 0:
            return
        if monitor.run_dir is None:
            self.why_not = "this model's records go to a sink, not a run dir: nothing for rank 0 to read"
            return
        self.follower = RunFollower(monitor.run_dir, ddp=getattr(monitor, "ddp_index", 0))
        self.follower.start()

    def due(self, step: int) -> bool:
        """Whether rank 0 logs at trainer step ``step`` (every ``every_n_steps``)."""
        if self.follower is None or step - self._last_due < self.every_n_steps:
            return False
        self._last_due = step
        return True

    def take(self) -> Update:
        """What is ready to log (empty on ranks other than 0)."""
        if self.follower is None:
            return Update()
        update = self.follower.take()
        self.findings_seen += len(update.findings)
        return update

    def read_error(self) -> str | None:
        """Why rank 0's reading of the run dir failed, the first time it did (then None): the
        reading goes on, and training is never stopped for it."""
        error = self.follower.error if self.follower is not None else self._final_error
        if error is None or self._error_said:
            return None
        self._error_said = True
        return f"ddpdoctor: reading the run dir failed ({type(error).__name__}: {error}); figures may be missing"

    def finish(self) -> Update:
        """Close the monitor this callback attached (its log ended and flushed); rank 0 reads once
        more and stops reading. Returns what was left to log."""
        if self.attached_here and self.monitor is not None:
            self.monitor.close()
        if self.follower is None:
            return Update()
        follower = self.follower
        deadline = time.monotonic() + (FINISH_WAIT_S if self.attached_here else 0.0)
        follower.poll()
        # a bounded wait on rank 0 alone, after its last step (the ranks have nothing left to
        # exchange): without it the other ranks' last steps are not in the run dir yet
        while not follower.all_ended() and time.monotonic() < deadline:
            time.sleep(FINISH_POLL_S)
            follower.poll()
        update = follower.take()
        update = dataclasses.replace(update, findings=[f for f in update.findings if f.code not in NOT_AT_FINISH])
        self.findings_seen += len(update.findings)
        follower.close()
        self._final_error, self.follower = follower.error, None
        return update


__all__ = [
    "EVERY_N_STEPS",
    "FINDINGS_COUNT_KEY",
    "FINDINGS_KEY",
    "TrainerWatch",
    "finding_line",
    "finding_markdown",
    "log_finding",
    "metrics_of",
]
