"""The trainer callbacks on real runs: Lightning ``Trainer(strategy="ddp")`` and transformers'
``Trainer`` on 2 gloo ranks on CPU, each with a planted straggler, read back with TensorBoard's own
event reader; Weights & Biases in offline mode, its run file read back; and a callback beside
``ddpdoctor run`` (one monitor per model: never attached twice).

Each test skips, saying why, without its optional packages (the ``lightning``, ``transformers``,
``tensorboard`` and ``wandb`` extras).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import struct
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any

import pytest

import ddpdoctor
from ddpdoctor.integrations.figures import RANK_FIGURES, RUN_FIGURES
from tests.ddp_harness import run_tree, torchrun_cmd

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "integrations"
STEPS = 40
EVERY = 10
#: The planted straggler: the last rank is this much slower at every step.
STRAGGLE_MS = 80.0

pytestmark = pytest.mark.slow


def _missing(*modules: str) -> str:
    """Why a test cannot run here ("" where it can): the optional packages not installed."""
    gone = [m for m in modules if importlib.util.find_spec(m) is None]
    if not gone:
        return ""
    extras = " ".join(f"'ddpdoctor[{m}]'" for m in gone)
    return f"{', '.join(gone)} not installed (pip install {extras})"


def _skip_without(*modules: str) -> None:
    why = _missing(*modules)
    if why:
        pytest.skip(why)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPDOCTOR_", "TORCHELASTIC_", "WANDB_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tui"), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _events(directory: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _texts(acc: Any, tag: str) -> list[str]:
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)]


def _check_series(acc: Any, prefix: str, points: int = STEPS - 2) -> None:
    """Every figure of every rank and of the run is a series of at least ``points`` steps; the
    straggler's lateness shows."""
    scalars = set(acc.Tags()["scalars"])
    for name in RANK_FIGURES:
        for rank in (0, 1):
            tag = f"{prefix}ddpdoctor/{name}/rank_{rank}"
            assert tag in scalars, (tag, sorted(scalars))
            assert len(acc.Scalars(tag)) >= points, (tag, len(acc.Scalars(tag)))
    for name in RUN_FIGURES:
        assert f"{prefix}ddpdoctor/run/{name}" in scalars
    late = {r: median(e.value for e in acc.Scalars(f"{prefix}ddpdoctor/lateness_ms/rank_{r}")) for r in (0, 1)}
    assert late[1] > STRAGGLE_MS / 4, late
    assert late[1] > late[0] + STRAGGLE_MS / 4, late
    lost = median(e.value for e in acc.Scalars(f"{prefix}ddpdoctor/run/lost_to_stragglers_ms"))
    assert lost > STRAGGLE_MS / 4


def _check_straggler_named(acc: Any, tag: str, log_text: str) -> None:
    assert tag in acc.Tags()["tensors"], (acc.Tags()["tensors"], log_text[-3000:])
    texts = _texts(acc, tag)
    assert any("`straggler` (rank 1)" in t for t in texts), texts
    # ... and in the trainer's own log
    assert "ddpdoctor [warning] straggler" in log_text, log_text[-3000:]


def _one_monitor_per_rank(run_dir: Path) -> None:
    run = ddpdoctor.load_run(run_dir)
    assert sorted(run.ranks) == [0, 1]
    assert run.other_models == []  # a second monitor on the model would have written rank-N.ddp1.jsonl
    for log in run.ranks.values():
        assert len(log.headers) == 1
        assert log.end is not None


def _lightning(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(EXAMPLES / "lightning_train.py"), "--steps", str(STEPS), "--every", str(EVERY)]
    argv += ["--straggle-ms", str(STRAGGLE_MS), *args]
    proc = run_tree(argv, tmp_path, env or _env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lightning training done" in proc.stdout
    return proc


def test_lightning_tensorboard_and_csv_loggers(tmp_path: Path) -> None:
    _skip_without("lightning", "tensorboard")
    proc = _lightning(tmp_path, "--logger", "tensorboard,csv", "--save-dir", "tb", "--run-dir", "rd")
    acc = _events(tmp_path / "tb" / "lightning" / "version_0")
    _check_series(acc, "")  # every step but the last (it ends when the log closes)
    _check_straggler_named(acc, "ddpdoctor/findings/text_summary", proc.stderr + proc.stdout)
    assert "train_loss" in acc.Tags()["scalars"]  # beside the trainer's own series
    _one_monitor_per_rank(tmp_path / "rd")
    # every logger the trainer has gets them: the CSV file too
    with (tmp_path / "tb" / "lightning-csv" / "version_0" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    for rank in (0, 1):
        logged = [row for row in rows if row.get(f"ddpdoctor/lateness_ms/rank_{rank}")]
        assert len(logged) >= STEPS - 2, (rank, len(logged))
    assert any(row.get("ddpdoctor/run/findings") for row in rows)


def test_lightning_beside_ddpdoctor_run(tmp_path: Path) -> None:
    _skip_without("lightning", "tensorboard")
    script = [sys.executable, str(EXAMPLES / "lightning_train.py"), "--steps", str(STEPS), "--every", str(EVERY)]
    script += ["--straggle-ms", str(STRAGGLE_MS), "--logger", "tensorboard", "--save-dir", "tb"]
    argv = [sys.executable, "-m", "ddpdoctor", "run", "--run-dir", "rd", "--", *script]
    proc = run_tree(argv, tmp_path, _env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the callback took the monitor ``ddpdoctor run`` attached, and read the run dir it writes;
    # that monitor closes after training, so the steps the other rank had not written out by
    # then are not in the series
    _one_monitor_per_rank(tmp_path / "rd")
    _check_series(_events(tmp_path / "tb" / "lightning" / "version_0"), "", points=EVERY)


def test_transformers_trainer_report_to_tensorboard(tmp_path: Path) -> None:
    _skip_without("transformers", "tensorboard")
    import torch

    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 6):
        pytest.skip(f"transformers' Trainer needs torch 2.6 or later (torch {torch.__version__})")
    argv = torchrun_cmd(
        str(EXAMPLES / "transformers_train.py"),
        *("--steps", str(STEPS), "--every", str(EVERY), "--straggle-ms", str(STRAGGLE_MS)),
        *("--logging-dir", "tb", "--run-dir", "rd"),
    )
    proc = run_tree(argv, tmp_path, _env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    acc = _events(tmp_path / "tb")
    _check_series(acc, "train/")  # the integration puts the training logs under train/
    _check_straggler_named(acc, "train/ddpdoctor/findings/text_summary", proc.stderr + proc.stdout)
    assert "train/loss" in acc.Tags()["scalars"]
    _one_monitor_per_rank(tmp_path / "rd")
    # the ranks close their logs one after another at the end: no rank is called lost for it
    assert "rank-lost" not in proc.stderr + proc.stdout


def wandb_history(run_file: Path) -> list[dict[str, str]]:
    """The history rows (key -> JSON value) of a W&B run file (``run-<id>.wandb``).

    The file is W&B's record log: a 7-byte header, then 32 KiB blocks of chunks (4-byte checksum,
    2-byte length, 1-byte type: full, first, middle, last), each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    block, pos, records, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            partial = chunk
        else:
            partial += chunk
            if kind == 4:
                records.append(partial)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


def test_lightning_wandb_offline(tmp_path: Path) -> None:
    _skip_without("lightning", "wandb")
    _lightning(tmp_path, "--logger", "wandb", "--save-dir", "wb", env=_env(WANDB_MODE="offline", WANDB_SILENT="true"))
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    rows = wandb_history(next(runs[0].glob("run-*.wandb")))
    for rank in (0, 1):
        for name in RANK_FIGURES:
            logged = [row for row in rows if f"ddpdoctor/{name}/rank_{rank}" in row]
            assert len(logged) >= STEPS - 2, (name, rank, len(logged))
    late = median(float(row["ddpdoctor/lateness_ms/rank_1"]) for row in rows if "ddpdoctor/lateness_ms/rank_1" in row)
    assert late > STRAGGLE_MS / 4
    # the findings: a table file per finding logged, the straggler among them
    tables = [p.read_text() for p in (runs[0] / "files" / "media" / "table" / "ddpdoctor").glob("findings_*.json")]
    assert any('"straggler"' in t for t in tables), tables
