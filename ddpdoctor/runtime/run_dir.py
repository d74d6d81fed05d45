"""Where a rank writes: the run dir every rank agrees on, and this rank's file in it."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddpdoctor.categories import LogWriteWarning, warn
from ddpdoctor.events import environment
from ddpdoctor.events.layout import DEFAULT_ROOT, RUN_DIR_ENV, new_run_name, rank_file_path
from ddpdoctor.sinks import FileSink, NullSink, Sink, SinkError

_AGREE_TIMEOUT = timedelta(seconds=30)

_opened: dict[str, int] = {}


def resolve(explicit: str | os.PathLike[str] | None, rank: int, store: Any, key_suffix: str) -> Path:
    """The run dir: explicit > $DDPDOCTOR_RUN_DIR > agreed with rank 0 through the rendezvous store.

    The store is the process group's key-value store, not a collective: rank 0 publishes a
    fresh name and the others read it. If that fails, this rank picks its own (and says so).
    """
    if explicit is not None:
        return Path(explicit)
    env = environment.read(RUN_DIR_ENV)
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
        except Exception as exc:  # noqa: BLE001 - a store failure means this rank writes alone; it must never break training
            warn(
                f"ddpdoctor: could not agree on a run dir with rank 0 ({exc}); this rank writes alone",
                LogWriteWarning,
                stacklevel=3,
            )
            name = None
    return Path(DEFAULT_ROOT) / (name or new_run_name())


def elastic_attempt() -> int | None:
    """This process's torchelastic attempt when the run can restart, else None.

    torchrun restarts every worker after a failure (``--max-restarts``) with the same RANK and
    the same run dir, and ``TORCHELASTIC_RESTART_COUNT`` counted up: each attempt gets a folder of
    its own so a restarted rank never appends to, or is mixed with, the log of the attempt before.
    Runs that cannot restart keep the flat layout (one file per rank directly in the run dir).
    """
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    try:
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) <= 0:
            return None
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return None


def rank_file(run_dir: Path, rank: int) -> tuple[Path, int]:
    """This rank's file (in its attempt's folder, if any), and the model's index in this process."""
    attempt = elastic_attempt()
    key = f"{rank_file_path(run_dir, rank, 0, attempt).parent.resolve()}#{rank}"
    index = _opened.get(key, 0)
    _opened[key] = index + 1
    return rank_file_path(run_dir, rank, index, attempt), index


def open_file_sink(
    explicit: str | os.PathLike[str] | None, rank: int, mode: str | None
) -> tuple[Sink, Path, Path | None, int]:
    """This rank's log file in the run dir, opened: (sink, run dir, file or None, DDP index).

    Where the file cannot be opened it warns and returns a ``NullSink`` (training goes on)."""
    import torch.distributed as dist

    from ddpdoctor.runtime import torch_compat

    store = None
    if explicit is None and not environment.read(RUN_DIR_ENV) and dist.is_initialized():
        try:
            store = torch_compat.default_store()
        except Exception:  # noqa: BLE001 - no store means rank-local naming; attaching must never break training
            store = None
    directory = resolve(explicit, rank, store, "0")
    path, ddp_index = rank_file(directory, rank)
    try:
        return FileSink(path, mode=mode), directory, path, ddp_index
    except SinkError as exc:
        warn(f"ddpdoctor: {exc}; training goes on without a log", LogWriteWarning, stacklevel=4)
        return NullSink(), directory, None, ddp_index
