"""Reading a run back: all ranks, tail-able, tolerant of torn and corrupt lines. No torch."""

from __future__ import annotations

from ddpdoctor.runlog.rank_file import RankFileTail, RankLog
from ddpdoctor.runlog.run import Run, RunDirError, load_run, rank_files

__all__ = ["RankFileTail", "RankLog", "Run", "RunDirError", "load_run", "rank_files"]
