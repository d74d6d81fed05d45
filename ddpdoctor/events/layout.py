"""The run-dir layout and the environment variables: the names every writer and reader agrees on.

A run dir holds one append-only file per rank and DDP model::

    RUN_DIR/rank-00003.jsonl            rank 3, its first DDP model
    RUN_DIR/rank-00003.ddp1.jsonl       rank 3, its second DDP model
    RUN_DIR/attempt-2/rank-00003.jsonl  the same under a torchrun that may restart (attempt 2)

Written by ``runtime.run_dir`` (a rank's own file) and ``cli.collect_cmd`` (a streamed rank),
read by ``runlog.run`` and ``runlog.source``. Nothing here imports anything heavy.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

#: The run dir (set by ``ddpdoctor run`` and ``ddpdoctor demo``); wins over all but an explicit argument.
RUN_DIR_ENV = "DDPDOCTOR_RUN_DIR"
#: Where ``instrument`` streams its records when no ``endpoint`` is given (``ddpdoctor run --endpoint``).
ENDPOINT_ENV = "DDPDOCTOR_ENDPOINT"
#: The shared secret a sender presents in its hello and a listener off loopback requires.
TOKEN_ENV = "DDPDOCTOR_TOKEN"
#: Seconds without progress before the hang watchdog records where a rank is (0: off).
HANG_TIMEOUT_ENV = "DDPDOCTOR_HANG_TIMEOUT"
#: What the rank files keep: "compact" (default: full step records at sampled steps and around
#: anything anomalous, windows of per-step columns otherwise) or "full" (a full record per step).
LOG_MODE_ENV = "DDPDOCTOR_LOG"

#: Where run dirs go when nobody says (relative to the working directory).
DEFAULT_ROOT = "ddpdoctor-runs"
#: Folder of one elastic attempt inside a run dir: ``attempt-0``, ``attempt-1``, ...
ATTEMPT_PREFIX = "attempt-"
RANK_FILE_PREFIX = "rank-"
RANK_FILE_SUFFIX = ".jsonl"
#: Between the rank and the suffix for a process's second and later DDP models.
DDP_INFIX = ".ddp"


def new_run_name() -> str:
    """A fresh run dir name: local time and a random tag (``20260101-120000-a1b2c3``)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def rank_file_name(rank: int, ddp: int = 0) -> str:
    """``rank-00003.jsonl`` (``ddp`` 0) or ``rank-00003.ddp1.jsonl``."""
    infix = "" if ddp == 0 else f"{DDP_INFIX}{ddp}"
    return f"{RANK_FILE_PREFIX}{rank:05d}{infix}{RANK_FILE_SUFFIX}"


def parse_rank_file_name(name: str) -> tuple[int, int] | None:
    """(rank, ddp index) from a rank file's name; None for any other name."""
    if not (name.startswith(RANK_FILE_PREFIX) and name.endswith(RANK_FILE_SUFFIX)):
        return None
    middle = name[len(RANK_FILE_PREFIX) : -len(RANK_FILE_SUFFIX)]
    rank_part, _, ddp_part = middle.partition(DDP_INFIX)
    try:
        return int(rank_part), int(ddp_part) if ddp_part else 0
    except ValueError:
        return None


def attempt_dir_name(attempt: int) -> str:
    """``attempt-N``: the folder of one elastic attempt."""
    return f"{ATTEMPT_PREFIX}{attempt}"


def parse_attempt_dir_name(name: str) -> int | None:
    """N from ``attempt-N``; None for any other name."""
    if not name.startswith(ATTEMPT_PREFIX):
        return None
    try:
        return int(name[len(ATTEMPT_PREFIX) :])
    except ValueError:
        return None


def rank_file_path(run_dir: Path, rank: int, ddp: int = 0, attempt: int | None = None) -> Path:
    """Where the file of ``rank`` (model ``ddp``, elastic ``attempt`` or None) lies in ``run_dir``."""
    folder = run_dir if attempt is None else run_dir / attempt_dir_name(attempt)
    return folder / rank_file_name(rank, ddp)
