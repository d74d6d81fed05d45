"""Optimizer steps with no all-reduce behind them: a backward inside ``no_sync()`` right before
the weights change (every micro-step of an accumulation in ``no_sync``, an off-by-one).

Read only around ``no_sync`` forwards (the monitor's full path; a synchronizing forward after a
synchronizing step is never one of them): at such a forward the version counters of two of DDP's
reduced parameters are noted; at the next forward, a change means something updated the weights in
place (the optimizer) after a backward DDP did not all-reduce. Two such updates make a finding.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analysis.accumulation import unsynced_updates
from ddpdoctor.analysis.findings import Finding

#: Updates after an unsynchronized backward before the finding is raised.
UPDATES_TO_RAISE = 2


class UnsyncedUpdates:
    """One DDP instance's watch on one rank."""

    def __init__(self, params: list[Any], reduced: list[bool], rank: int) -> None:
        trained = [p for p, r in zip(params, reduced, strict=False) if r and p.requires_grad]
        # the first and the last reduced parameter: an optimizer that steps the model changes them
        self._watched = [trained[0], trained[-1]] if trained else []
        self.rank = rank
        #: versions at the last no_sync forward (None: not one; a synchronizing forward after a
        #: synchronizing one need not call ``on_forward``)
        self.noted: int | None = None
        self.updates = 0
        self.micro = 0
        self.reported = False

    def _version(self) -> int:
        return sum(int(p._version) for p in self._watched)

    def on_forward(self, sync: bool, step: int, ever_synced: bool) -> Finding | None:
        """A training forward (``sync``: outside no_sync). A finding once the weights changed
        ``UPDATES_TO_RAISE`` times after a backward that DDP did not all-reduce."""
        found = None
        if self.noted is not None:
            if self._version() != self.noted:
                self.updates += 1
                if self.updates >= UPDATES_TO_RAISE and not self.reported:
                    self.reported = True
                    found = unsynced_updates(self.rank, step, self.updates, self.micro, ever_synced)
            self.noted = None
        if not sync and self._watched and not self.reported:
            self.micro += 1
            self.noted = self._version()
        return found
