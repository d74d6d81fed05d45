"""Reading a run back: all ranks, tail-able, tolerant of torn and corrupt lines. No torch."""

from __future__ import annotations

from ddpdoctor.runlog.rank_file import RankFileTail, RankLog
from ddpdoctor.runlog.run import Run, RunDirError, load_run, rank_files
from ddpdoctor.runlog.source import DirSource, RankRecord, RecordSource, SourceHealth

__all__ = [
    "DirSource",
    "RankFileTail",
    "RankLog",
    "RankRecord",
    "RecordSource",
    "Run",
    "RunDirError",
    "SourceHealth",
    "load_run",
    "rank_files",
]
