"""Where a rank writes: the run dir every rank agrees on, and this rank's file in it."""

from __future__ import annotations

import os
import secrets
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddpdoctor.categories import LogWriteWarning

#: Set by ``ddpdoctor run`` and ``ddpdoctor demo``; wins over everything but an explicit argument.
RUN_DIR_ENV = "DDPDOCTOR_RUN_DIR"
DEFAULT_ROOT = "ddpdoctor-runs"
_AGREE_TIMEOUT = timedelta(seconds=30)

_opened: dict[str, int] = {}


def new_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def resolve(explicit: str | os.PathLike[str] | None, rank: int, store: Any, key_suffix: str) -> Path:
    """The run dir: explicit > $DDPDOCTOR_RUN_DIR > agreed with rank 0 through the rendezvous store.

    The store is the process group's key-value store, not a collective: rank 0 publishes a
    fresh name and the others read it. If that fails, this rank picks its own (and says so).
    """
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get(RUN_DIR_ENV)
    if env:
        return Path(env)
    name = None
    if store is not None:
        key = f"ddpdoctor/run_dir/{key_suffix}"
        try:
            if rank == 0:
                name = new_run_name()
                store.set(key, name)
            else:
                store.wait([key], _AGREE_TIMEOUT)
                name = store.get(key).decode()
        except Exception as exc:
            warnings.warn(f"ddpdoctor: could not agree on a run dir with rank 0 ({exc}); this rank writes alone",
                          LogWriteWarning, stacklevel=3)
            name = None
    return Path(DEFAULT_ROOT) / (name or new_run_name())


def rank_file(run_dir: Path, rank: int) -> tuple[Path, int]:
    """This rank's file, and the model's index in this process (several DDP models per rank)."""
    key = f"{run_dir.resolve()}#{rank}"
    index = _opened.get(key, 0)
    _opened[key] = index + 1
    suffix = "" if index == 0 else f".ddp{index}"
    return run_dir / f"rank-{rank:05d}{suffix}.jsonl", index
