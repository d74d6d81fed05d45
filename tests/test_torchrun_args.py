"""What `ddpdoctor run` reads from a torchrun command: restart advice and a run dir shared by nodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpdoctor.cli.torchrun_args import (
    SHARE_STORE_ENV,
    TorchrunArgs,
    parse,
    port_advice,
    restart_advice,
    shared_run_name,
)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def test_options_are_read_in_every_spelling() -> None:
    args = parse(
        [
            "torchrun",
            "--max_restarts=2",
            "--rdzv-backend",
            "c10d",
            "--standalone",
            "--rdzv_id",
            "job 7",
            "--nnodes",
            "1:4",
            "train.py",
            "--max-restarts",
            "9",
        ],
        env={},
    )
    assert args == TorchrunArgs(max_restarts=2, rdzv_backend="c10d", rdzv_id="job 7", nnodes="1:4", standalone=True)
    assert args.max_nodes == 4 and args.backend == "c10d"
    # the script's own options (after train.py) are not torchrun's; a flag takes no value
    assert parse([*TORCHRUN, "-m", "pkg.train", "--nnodes", "3"], env={}) == TorchrunArgs()
    # torchrun's PET_* environment fallbacks, and commands that are not torchrun
    from_env = parse(["/usr/bin/torchrun", "t.py"], env={"PET_MAX_RESTARTS": "3"})
    assert from_env is not None and from_env.max_restarts == 3
    assert parse([sys.executable, "train.py"], env={}) is None
    launch = parse([sys.executable, "-m", "torch.distributed.launch", "--nnodes=2", "t.py"], env={})
    assert launch is not None and launch.max_nodes == 2


def test_restart_advice_names_what_breaks_restarts() -> None:
    assert restart_advice(TorchrunArgs(max_restarts=0), env={}) is None
    static = restart_advice(TorchrunArgs(max_restarts=1), env={SHARE_STORE_ENV: "1"})
    assert static is not None and "--rdzv-backend c10d" in static and f"{SHARE_STORE_ENV}=1" in static
    shared = restart_advice(TorchrunArgs(max_restarts=1, standalone=True), env={})
    assert shared is not None and f"Set {SHARE_STORE_ENV}=1" in shared
    assert restart_advice(TorchrunArgs(max_restarts=1, rdzv_backend="c10d"), env={SHARE_STORE_ENV: "1"}) is None


def test_master_port_0_is_said_to_hang() -> None:
    # (torchrun --master-port 0 hangs in init_process_group, with or without ddpdoctor)
    for spelling in (["--master-port", "0"], ["--master_port=0"]):
        args = parse([*TORCHRUN, "--nproc-per-node", "2", *spelling, "t.py"], env={})
        assert args is not None and args.master_port == "0"
        advice = port_advice(args)
        assert advice is not None and "--standalone" in advice
    from_env = parse([*TORCHRUN, "t.py"], env={"PET_MASTER_PORT": "0"})
    assert from_env is not None and port_advice(from_env) is not None
    assert port_advice(parse([*TORCHRUN, "--master-port", "29511", "t.py"], env={}) or TorchrunArgs()) is None
    assert port_advice(TorchrunArgs(master_port="0", standalone=True)) is None  # the c10d rendezvous picks one
    assert port_advice(TorchrunArgs()) is None


def test_a_multi_node_job_gets_a_run_dir_named_by_its_rdzv_id() -> None:
    assert shared_run_name(TorchrunArgs(nnodes="2", rdzv_id="slurm/4711")) == "rdzv-slurm_4711"
    assert shared_run_name(TorchrunArgs(nnodes="1", rdzv_id="job")) is None  # one node: a fresh name
    assert shared_run_name(TorchrunArgs(nnodes="2")) is None  # no id: nothing shared to name it by
    assert shared_run_name(TorchrunArgs(nnodes="2", rdzv_id="..")) is None


def _run(tmp_path: Path, torchrun_options: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`ddpdoctor run -- torchrun OPTIONS --help`: torchrun prints its help and exits, fast. No rank
    starts, so ``ddpdoctor run`` is told not to build the native comm hook first (a child
    process importing torch: seconds on a busy machine, for nothing here)."""
    return subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "run", "--", *TORCHRUN, *torchrun_options, "--help"],
        cwd=tmp_path,
        env=dict(env, DDPDOCTOR_NATIVE="0"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_prints_restart_advice_and_the_shared_run_dir(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPDOCTOR_", "PET_")) and k != SHARE_STORE_ENV}
    proc = _run(tmp_path, ["--max-restarts", "1", "--nnodes", "2", "--rdzv-id", "job7"], env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"run dir {tmp_path / 'ddpdoctor-runs' / 'rdzv-job7'}" in proc.stdout
    assert "ddpdoctor run: note: torchrun's static rendezvous" in proc.stderr
    proc = _run(tmp_path, ["--master-port", "0"], env)
    assert proc.returncode == 0 and "ddpdoctor run: note: torchrun --master-port 0" in proc.stderr

    # an earlier job with the same id left files: a fresh dir and a warning, never an append
    (tmp_path / "ddpdoctor-runs" / "rdzv-job7").mkdir(parents=True)
    (tmp_path / "ddpdoctor-runs" / "rdzv-job7" / "rank-00000.jsonl").write_text("")
    proc = _run(
        tmp_path,
        ["--nnodes", "2", "--rdzv-id", "job7", "--rdzv-backend", "c10d", "--max-restarts", "1"],
        dict(env, **{SHARE_STORE_ENV: "1"}),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rdzv-job7" not in proc.stdout.splitlines()[0] and "already holds a run of --rdzv-id 'job7'" in proc.stderr
    assert "note:" not in proc.stderr  # c10d with a store per round: nothing to advise


@pytest.mark.parametrize("options", [["--nnodes", "1"], ["--nnodes", "2"]])
def test_a_single_node_or_unnamed_job_gets_a_fresh_dir(tmp_path: Path, options: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPDOCTOR_", "PET_"))}
    proc = _run(tmp_path, options, env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = next(line for line in proc.stdout.splitlines() if line.startswith("ddpdoctor run: run dir "))
    assert "/ddpdoctor-runs/" in run_dir and "rdzv-" not in run_dir
    assert ("names its run dir alone" in proc.stderr) == (options[1] == "2")
