"""Rank 0's reading of its run while it trains: what the trainer callbacks log.

The ranks already write their logs to the run dir (``ddpdoctor run`` also streams them); rank 0
tails those files, so the callbacks add no collective and no traffic between the ranks. The
reading runs on a thread of its own (``start``), never on the training thread, which only takes
what is ready (``take``) at its logging steps: parsing the other ranks' records at a step
boundary would make rank 0 late there, a straggler of ddpdoctor's own making.

A step's figures (``figures.step_figures``) are computed once every rank of the run logged it;
the findings are the live view's (``analysis.live_run.LiveRun``: the cross-rank detectors over a
sliding window, and each rank's own finding records), each handed over once, when it first shows.
Memory stays bounded: steps are kept per rank for ``HISTORY`` steps.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.live_run import LiveRun, poll_source
from ddpdoctor.events import End, Header, Step, Window
from ddpdoctor.integrations.figures import StepFigures, step_figures
from ddpdoctor.runlog.source import DirSource, RankRecord
from ddpdoctor.runlog.windows import window_steps

#: Steps kept per rank that no figure was computed for yet (a rank that stopped logging: older ones go).
HISTORY = 1024
#: Steps before the first new one that the clock alignment also reads.
CLOCK_STEPS = 10
#: Seconds between two reads of the run dir.
INTERVAL_S = 1.0


@dataclass
class Update:
    """What became known since the last ``take``: the figures of the steps every rank logged
    since, in step order, and the findings not handed over before."""

    steps: list[StepFigures] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def finding_key(f: Finding) -> tuple[str, tuple[int, ...], str]:
    """What makes a finding new: its code, ranks and severity (its figures change as the run goes on)."""
    return f.code, tuple(f.ranks), f.severity


class RunFollower:
    """Tails ``run_dir`` (DDP model ``ddp``: 0 the first each process wrapped) and turns it into
    ``Update``s. ``start`` reads on a daemon thread every ``interval_s``; ``poll`` reads once on
    the caller's thread (the last read, after training). Thread-safe: one reader at a time."""

    def __init__(self, run_dir: str | os.PathLike[str], ddp: int = 0, interval_s: float = INTERVAL_S) -> None:
        self.run_dir = Path(run_dir)
        self.ddp = ddp
        self.interval_s = interval_s
        self._source = DirSource(self.run_dir)
        self._live = LiveRun(label=self._source.label, attempt=self._source.attempt, ddp=ddp)
        self._steps: dict[int, dict[int, Step]] = {}
        self._headers: dict[int, Header] = {}
        self._ended: set[int] = set()
        self._done_upto = -1
        self._seen: set[tuple[str, tuple[int, ...], str]] = set()
        self._ready = Update()
        self._read_lock = threading.Lock()  # one reader of the files at a time
        self._ready_lock = threading.Lock()  # the update being built, between the reader and ``take``
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the last error of a read (the reading goes on; the callbacks say it once)
        self.error: BaseException | None = None

    def start(self) -> None:
        """Read on a daemon thread until ``close``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ddpdoctor-follow", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        """Read what the ranks wrote since the last read; never raises (``error`` keeps the cause)."""
        with self._read_lock:
            try:
                self._read()
            except Exception as exc:  # noqa: BLE001 - a bad read must never reach the training loop
                self.error = exc

    def all_ended(self) -> bool:
        """Whether every rank of the run closed its log (its end record was read)."""
        with self._read_lock:
            expected = max((h.whole_world_size() for h in self._headers.values()), default=0)
            return expected > 0 and len(self._ended) >= expected

    def take(self) -> Update:
        """The figures and findings ready since the last call (empty when nothing is new)."""
        with self._ready_lock:
            ready, self._ready = self._ready, Update()
        return ready

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the reading thread (joined within ``timeout_s``) and release the files."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._read_lock:
            self._source.close()

    # -- on the reading thread ----------------------------------------------------------------

    def _read(self) -> None:
        live, records = poll_source(self._live, self._source)
        if live is not self._live:  # torchrun restarted the workers: step numbers start over
            self._live, self._steps, self._headers, self._ended, self._done_upto = live, {}, {}, set(), -1
        for rr in records:
            self._keep(rr)
        found = self._complete_steps()
        new = []
        for f in self._live.snapshot().findings:
            key = finding_key(f)
            if key not in self._seen:
                self._seen.add(key)
                new.append(f)
        if found or new:
            with self._ready_lock:
                self._ready.steps.extend(found)
                self._ready.findings.extend(new)

    def _keep(self, rr: RankRecord) -> None:
        if rr.ddp != self.ddp:
            return
        rec = rr.record
        if isinstance(rec, Header):
            self._headers.setdefault(rr.rank, rec)
            return
        if isinstance(rec, End):
            self._ended.add(rr.rank)
            return
        if isinstance(rec, Step):
            steps = [rec]
        elif isinstance(rec, Window):
            steps = window_steps(rec)
        else:
            return
        kept = self._steps.setdefault(rr.rank, {})
        for s in steps:
            if s.step > self._done_upto:
                kept[s.step] = s  # a full record that comes after its window row replaces it
        if len(kept) > HISTORY:
            for old in sorted(kept)[: len(kept) - HISTORY]:
                del kept[old]

    def _complete_steps(self) -> list[StepFigures]:
        expected = max((h.whole_world_size() for h in self._headers.values()), default=0)
        if expected < 1 or len(self._steps) < expected:
            return []
        # up to the step every rank has reached: a rank's later records may still fill a gap below it
        reached = min((max(kept) for kept in self._steps.values() if kept), default=-1)
        common = set.intersection(
            *({k for k in kept if self._done_upto < k <= reached} for kept in self._steps.values())
        )
        if not common:
            return []
        first, last = min(common), max(common)
        window = {
            r: [kept[k] for k in sorted(kept) if first - CLOCK_STEPS <= k <= last] for r, kept in self._steps.items()
        }
        found = step_figures(window, self._headers, only=common)
        self._done_upto = last
        for kept in self._steps.values():  # what the clocks of the next read still need
            for k in [k for k in kept if k < last - CLOCK_STEPS]:
                del kept[k]
        return found
