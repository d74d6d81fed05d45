"""A whole run read back: every rank file of a run dir."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ddpdoctor.errors import InputError
from ddpdoctor.events.health import SourceHealth
from ddpdoctor.events.layout import attempt_dir_name, parse_attempt_dir_name, parse_rank_file_name
from ddpdoctor.runlog.rank_file import RankFileTail, RankLog, job_spans, read_job, read_sampled
from ddpdoctor.runlog.receiver import read_receiver_health


class RunDirError(InputError, ValueError):
    """The path is not a readable ddpdoctor run dir (message says why)."""


@dataclass
class Run:
    """A run dir's logs: ``ranks`` maps global rank to its log of DDP model ``ddp`` (the first
    DDP model each process wrapped, unless ``load_run`` was asked for another)."""

    dir: Path
    ranks: dict[int, RankLog] = field(default_factory=dict)
    other_models: list[RankLog] = field(default_factory=list)  # the other DDP models' logs
    ddp: int = 0  # which DDP model of each process ``ranks`` holds (0: the first one wrapped)
    attempt: int | None = None  # the elastic attempt read (``dir`` is then its ``attempt-N`` folder)
    attempts: list[int] = field(default_factory=list)  # every attempt the run dir holds
    #: jobs that wrote this run dir before the one read (``RankLog.earlier_jobs``; 0: one job)
    earlier_jobs: int = 0
    #: jobs that wrote it after the one read (``load_run(job=K)`` of an earlier job; else 0)
    later_jobs: int = 0
    #: what the stream receiver that wrote this run dir refused or lost (``ddpdoctor collect``;
    #: None: the ranks wrote it themselves)
    receiver: SourceHealth | None = None

    @property
    def corrupt_lines(self) -> int:
        return sum(log.corrupt_lines for log in self.ranks.values())

    @property
    def unknown_lines(self) -> int:
        return sum(log.unknown_lines for log in self.ranks.values())

    @property
    def world_size(self) -> int:
        """The ranks the headers promise: DDP's world, or the whole world where DDP runs over
        subgroups of it (``Header.group_ranks``)."""
        sizes = [log.header.whole_world_size() for log in self.ranks.values() if log.header is not None]
        return max(sizes) if sizes else len(self.ranks)

    def models(self) -> list[int]:
        """Every DDP model with a rank file here (0: the first one each process wrapped; a GAN's
        second model writes ``rank-NNNNN.ddp1.jsonl``)."""
        return sorted({self.ddp} | {log.ddp for log in self.other_models})

    def missing_ranks(self) -> list[int]:
        """Ranks the headers promise but for which there is no file."""
        promised: set[int] = set()
        for log in self.ranks.values():
            h = log.header
            if h is not None:
                # a subgroup's header names its group, and (newer logs) the whole world's size
                promised.update(
                    h.group_ranks if h.group_ranks and not h.dist_world_size else range(h.whole_world_size())
                )
        return sorted(promised - set(self.ranks))


def rank_files(directory: Path) -> list[tuple[Path, int, int]]:
    """(path, rank, ddp index) of every rank file in ``directory``, by rank."""
    found = []
    for entry in os.scandir(directory):
        parsed = parse_rank_file_name(entry.name)
        if parsed is not None and entry.is_file():
            found.append((Path(entry.path), parsed[0], parsed[1]))
    return sorted(found, key=lambda t: (t[1], t[2]))


def attempts(directory: Path) -> list[int]:
    """The elastic attempts (``attempt-N`` folders) of a run dir, oldest first."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        number = parse_attempt_dir_name(entry.name)
        if number is not None and entry.is_dir():
            found.append(number)
    return sorted(found)


def attempt_dir(directory: str | os.PathLike[str], attempt: int | None = None) -> tuple[Path, int | None]:
    """The folder holding the rank files to read, and its attempt number.

    A run that torchrun may restart keeps each attempt in ``attempt-N``: by default the latest
    one is read (the run as it ended); ``attempt`` picks another. Giving the ``attempt-N`` folder
    itself as the run dir works too. A flat run dir (no attempts) is returned as it is.
    """
    path = check_run_dir(directory)
    found = attempts(path)
    if attempt is not None:
        if attempt not in found:
            have = ", ".join(map(str, found)) or "none"
            raise RunDirError(f"{path}: no attempt {attempt} (attempts here: {have})")
        return path / attempt_dir_name(attempt), attempt
    if found and not rank_files(path):
        return path / attempt_dir_name(found[-1]), found[-1]
    return path, None


def check_run_dir(directory: str | os.PathLike[str]) -> Path:
    path = Path(directory)
    if not path.exists():
        raise RunDirError(f"{path}: no such directory")
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory (give the run dir, not a rank file)")
    return path


#: Step records a sampled load keeps over all ranks ("auto"): a few hundred MB of memory at most.
STEP_BUDGET = 250_000
#: ... but never fewer than this per rank, nor more.
MIN_STEPS_PER_RANK, MAX_STEPS_PER_RANK = 512, 8192


def load_run(
    directory: str | os.PathLike[str],
    attempt: int | None = None,
    max_steps: int | Literal["auto"] | None = None,
    ddp: int = 0,
    job: int | None = None,
) -> Run:
    """Read every rank file of a run dir (finished or still being written).

    Corrupt lines and a torn last line are skipped and counted per rank (``corrupt_lines``),
    never fatal. A run dir with elastic attempts (``attempt-N`` folders) is read at its latest
    attempt unless ``attempt`` says which. Raises ``RunDirError`` when the directory is missing
    or holds no rank file.

    ``ddp`` picks the DDP model whose logs ``ranks`` holds where a process wrapped several (0:
    the first; the others go to ``other_models``); ``RunDirError`` when it has no rank file.

    ``max_steps`` bounds the step records kept per rank (for very long or very wide runs): steps
    are then kept at a power-of-two stride of their index, the same on every rank, plus the last
    ones; every other record is kept and ``steps_total`` still counts all steps. ``"auto"``
    shares ``STEP_BUDGET`` among the rank files (what ``ddpdoctor report`` uses).

    A run dir that several jobs wrote one after another (two launches under one ``ddpdoctor
    run``: each rank file holds each job's process in turn, steps from 0 in each) is read at its
    last job (``earlier_jobs`` counts the others), or at job ``job`` (0 the first, -1 the last;
    ``RunDirError`` when there is no such job).
    """
    root = check_run_dir(directory)
    path, chosen = attempt_dir(root, attempt)
    files = rank_files(path)
    if not files:
        raise RunDirError(f"{path}: no rank files (rank-NNNNN.jsonl) here; is this a ddpdoctor run dir?")
    models = sorted({index for _, _, index in files})
    if ddp not in models:
        raise RunDirError(
            f"{path}: no rank files of DDP model {ddp} here (models with files: {', '.join(map(str, models))})"
        )
    run = Run(dir=path, attempt=chosen, attempts=attempts(root) if chosen is not None else [], ddp=ddp)
    run.receiver = read_receiver_health(root)
    if max_steps == "auto":
        max_steps = min(MAX_STEPS_PER_RANK, max(MIN_STEPS_PER_RANK, STEP_BUDGET // len(files)))
    segments: dict[int, int] | None = None  # file -> the process of the job asked for
    if job is not None:
        table = job_table(files)
        chosen = job if job >= 0 else len(table) + job
        if not 0 <= chosen < len(table):
            raise RunDirError(f"{path}: no job {job} here ({len(table)} job(s) wrote it: --job 0 to {len(table) - 1})")
        segments = table[chosen]
        run.earlier_jobs, run.later_jobs = chosen, len(table) - 1 - chosen
    collecting = gc.isenabled()
    gc.disable()  # many small objects that never form cycles: the collector would only rescan them
    try:
        for n, (file, rank, index) in enumerate(files):
            segment = None if segments is None else segments.get(n)
            if segments is not None and segment is None:
                continue  # a rank file without a process of that job
            if max_steps is None and segment is not None:
                log = read_job(file, rank, index, segment)
            elif max_steps is None:
                tail = RankFileTail(file, rank, index)
                tail.poll(final=True)
                log = tail.log
            else:
                log = read_sampled(file, rank, index, max_steps, segment)
            if segment is not None:
                log.earlier_jobs = run.earlier_jobs
            if index == ddp:
                run.ranks[rank] = log
            else:
                run.other_models.append(log)
    finally:
        if collecting:
            gc.enable()
    if segments is None:
        _last_job_only(run)
    return run


#: Processes of one job start within this much of each other, or of the job's span (the live
#: view's ``JOB_GAP_NS`` alike): ranks write their headers once DDP is built, a collective.
SAME_JOB_NS = 1_000_000_000


def job_table(files: list[tuple[Path, int, int]]) -> list[dict[int, int]]:
    """The jobs that wrote a run dir one after another, oldest first: for each, which process
    (0 the first) of each rank file (its index in ``files``) belongs to it. A job's processes run
    at the same time; the next job's start after they ended. A process without an End record (it
    crashed, or runs on) spans its start only."""
    spans: list[tuple[int, int, int, int]] = []  # (start, end, file, process)
    for n, (file, rank, index) in enumerate(files):
        for k, (start, end) in enumerate(job_spans(file, rank, index)):
            if start is not None:  # (a process whose header is unreadable cannot be placed)
                spans.append((start, end if end is not None else start, n, k))
    spans.sort()
    table: list[dict[int, int]] = []
    until = 0
    for start, end, n, k in spans:
        if not table or start > until + SAME_JOB_NS:
            table.append({})
            until = end
        table[-1].setdefault(n, k)
        until = max(until, end)
    return table


def _last_job_logs(logs: list[RankLog]) -> list[RankLog]:
    """The logs of the last job, where several jobs wrote the run dir one after another (a
    ``ddpdoctor run`` of two launches in turn, a script that spawns its ranks twice): each file
    is read from its last process on (``RankLog.earlier_jobs``), and a file whose last process
    ended before the last job began (a rank the last job did not have) is left out. The last job
    began when the first of the files that went on past an earlier job was opened again."""
    starts = [log.header.t_wall_ns for log in logs if log.header is not None and log.earlier_jobs]
    if not starts:
        return logs
    began = min(starts)
    return [log for log in logs if log.end is None or log.end.t_wall_ns >= began]


def _last_job_only(run: Run) -> None:
    """Keep the last job's logs in ``run`` where the run dir holds several (else nothing changes)."""
    logs = [*run.ranks.values(), *run.other_models]
    jobs = max((log.earlier_jobs for log in logs), default=0)
    if not jobs:
        return
    kept = {id(log) for log in _last_job_logs(logs)}
    run.earlier_jobs = jobs
    run.ranks = {r: log for r, log in run.ranks.items() if id(log) in kept}
    run.other_models = [log for log in run.other_models if id(log) in kept]
