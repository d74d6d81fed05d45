"""Where live records come from, the same to every reader: a run dir being written, or a stream.

A source is polled, never blocks, and hands back what arrived since the last poll, each record
tagged with its rank and DDP index. ``ddpdoctor watch`` and the live analysis only know this
interface, so tailing files and listening on a socket look alike to them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, Protocol

from ddpdoctor.events import Record
from ddpdoctor.events.health import SourceHealth
from ddpdoctor.runlog.rank_file import RankFileTail
from ddpdoctor.runlog.run import RunDirError, attempt_dir, check_run_dir, rank_files


class RankRecord(NamedTuple):
    """One record and who wrote it."""

    rank: int
    ddp: int
    record: Record


class RecordSource(Protocol):
    """Anything that yields records of a run as they arrive."""

    #: what the UI shows: the run dir, or "listening on HOST:PORT, run NAME". It names what the
    #: records come from: when it changes, a consumer starts afresh (``live_run.poll_source``).
    label: str
    #: the elastic attempt the records come from (None: not known, or a run that is not elastic).
    #: When it changes, torchrun restarted the workers: what came before belongs to another
    #: attempt, its step numbers start over, and a consumer starts afresh (``live_run.poll_source``).
    attempt: int | None

    def poll(self) -> list[RankRecord]:
        """Records that arrived since the last call, in arrival order per rank; never blocks long."""
        ...

    def health(self) -> SourceHealth: ...

    def close(self) -> None: ...


class DirSource:
    """Tails every rank file of a run dir; files that appear later are picked up on a later poll.

    A truncated or replaced file is read again from its start; a deleted one just stops. A run dir
    that torchrun may restart holds one ``attempt-N`` folder per attempt: the source tails the
    latest (as ``load_run`` reads it) and moves to a newer one as soon as it appears, dropping
    the old attempt's files (``attempt`` and ``label`` then name the new one). A poll never mixes
    records of two attempts.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes_per_poll: int = 8 << 20) -> None:
        self.root: Path = check_run_dir(directory)
        self.dir, self.attempt = attempt_dir(self.root)
        self.label = str(self.dir)
        self._tails: dict[Path, RankFileTail] = {}
        self._max = max_bytes_per_poll

    def _follow_attempt(self) -> None:
        try:
            folder, attempt = attempt_dir(self.root)
        except (RunDirError, OSError):
            return  # the run dir went away: keep what we have
        if folder != self.dir:
            self.dir, self.attempt, self.label = folder, attempt, str(folder)
            self._tails.clear()

    def poll(self) -> list[RankRecord]:
        self._follow_attempt()
        try:
            files = rank_files(self.dir)
        except OSError:
            files = []  # the dir went away: keep what we have
        for path, rank, ddp in files:
            if path not in self._tails:
                self._tails[path] = RankFileTail(path, rank, ddp, keep=False)
        out: list[RankRecord] = []
        for tail in self._tails.values():
            try:
                records = tail.poll(max_bytes=self._max)
            except OSError:
                continue
            out.extend(RankRecord(tail.log.rank, tail.log.ddp, r) for r in records)
        return out

    def health(self) -> SourceHealth:
        logs = [t.log for t in self._tails.values()]
        return SourceHealth(sum(g.corrupt_lines for g in logs), sum(g.unknown_lines for g in logs), 0)

    def close(self) -> None:
        self._tails.clear()
