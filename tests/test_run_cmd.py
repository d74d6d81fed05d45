"""``ddpdoctor run``: unmodified scripts instrumented from outside (torchrun, mp.spawn, a comm hook,
Lightning), exit codes, signals, elastic attempts, and what the hook must not do."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest

import ddpdoctor
from ddpdoctor.events import Header
from ddpdoctor.runlog import RankFileTail
from tests.ddp_harness import free_port, run_tree, torchrun_cmd

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "zero_code"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DDPDOCTOR_", "TORCHELASTIC_"))}


def _env_no_torch() -> dict[str, str]:
    """For a CMD that never imports torch: ``ddpdoctor run`` skips building the native comm hook
    first (a child process importing torch, seconds on a busy machine), which no process of CMD
    would load. Every test here whose CMD trains still runs that step."""
    return dict(_env(), DDPDOCTOR_NATIVE="0")


def ddpdoctor_run(
    tmp_path: Path, cmd: list[str], *options: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``ddpdoctor run OPTIONS -- CMD`` in its own session: on a timeout the whole tree is killed."""
    argv = [sys.executable, "-m", "ddpdoctor", "run", *options, "--", *cmd]
    return run_tree(argv, tmp_path, env or _env(), timeout)


def _printed_run_dir(proc: subprocess.CompletedProcess[str]) -> Path:
    line = next(s for s in proc.stdout.splitlines() if s.startswith("ddpdoctor run: run dir "))
    return Path(line.removeprefix("ddpdoctor run: run dir "))


def _headers(path: Path) -> list[Header]:
    tail = RankFileTail(path, 0, 0)
    tail.poll(final=True)
    return tail.log.headers


BOTH_SCRIPT = """
        import torch, torch.distributed as dist
        from torch import nn
        import ddpdoctor

        dist.init_process_group("gloo")
        def train():
            a = torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
            with ddpdoctor.instrument(a) as m:             # explicit, after the hook attached
                b = ddpdoctor.DistributedDataParallel(nn.Linear(4, 4))   # the drop-in
                for _ in range(3):
                    a(torch.randn(2, 4)).sum().backward()
                    b(torch.randn(2, 4)).sum().backward()
                b.ddpdoctor.close()
        train()
        dist.destroy_process_group()
    """

BROKEN_SCRIPT = """
        import sys, torch, torch.distributed as dist
        from torch import nn
        sys.modules["ddpdoctor.runtime.monitor"] = None   # ddpdoctor's runtime cannot be imported here
        dist.init_process_group("gloo")
        def train():
            for _ in range(2):   # two models: still one warning
                model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
                model(torch.randn(2, 4)).sum().backward()
        train()
        print("trained", flush=True)
        dist.destroy_process_group()
    """

ORDER_SCRIPT = """
        import weakref, torch, torch.distributed as dist
        from torch import nn
        dist.init_process_group("gloo")
        def train():
            model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
            weakref.finalize(model, print, "model freed", flush=True)
            for _ in range(3):
                model(torch.randn(2, 4)).sum().backward()
        train()
        dist.destroy_process_group()
        print("group destroyed", flush=True)
    """

#: Gradual unfreezing done by hand: a new DDP over the same module after unfreezing its first
#: layer, as DDP requires (and a second model, a module of its own, beside it).
REWRAP_SCRIPT = """
        import torch, torch.distributed as dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        net[0].weight.requires_grad_(False)
        ddp = DDP(net)
        other = DDP(nn.Linear(2, 2))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        losses = []
        for stage in range(2):
            for _ in range(4):
                loss = other(ddp(torch.randn(4, 8, generator=g))).pow(2).mean()
                opt.zero_grad(); loss.backward(); opt.step()
                losses.append(loss.item())
            net[0].weight.requires_grad_(True)
            ddp = DDP(net)
        if dist.get_rank() == 0:
            print("losses", losses, flush=True)
        dist.destroy_process_group()
    """


def _scripted(name: str, text: str, nproc: int) -> Callable[[Path], list[str]]:
    def cmd(tmp_path: Path) -> list[str]:
        script = tmp_path / name
        script.write_text(textwrap.dedent(text))
        return torchrun_cmd(str(script), nproc=nproc)

    return cmd


#: The module's real training jobs whose checks do not depend on timing: ``ddpdoctor run OPTIONS
#: -- CMD``, each in a folder of its own (its cwd). They run side by side, a few at a time, from
#: the first test that needs one; each test reads its own job's result.
JOBS: dict[str, tuple[Callable[[Path], list[str]], tuple[str, ...], float]] = {
    "torchrun": (lambda _: torchrun_cmd(str(EXAMPLES / "torchrun_train.py"), "--steps", "5"), (), 180),
    "spawn": (
        lambda _: [sys.executable, str(EXAMPLES / "spawn_train.py"), "--steps", "4"],
        ("--run-dir", "spawned"),
        180,
    ),
    "comm_hook": (
        lambda _: torchrun_cmd(str(EXAMPLES / "comm_hook_train.py"), "--steps", "6"),
        ("--run-dir", "hooked"),
        180,
    ),
    "lightning": (
        lambda _: [sys.executable, str(EXAMPLES / "lightning_train.py"), "--steps", "5"],
        ("--run-dir", "lightning"),
        240,
    ),
    "transformers": (
        lambda _: torchrun_cmd(str(EXAMPLES / "transformers_train.py"), "--steps", "8"),
        ("--run-dir", "transformers"),
        240,
    ),
    "both": (_scripted("both.py", BOTH_SCRIPT, 2), ("--run-dir", "run"), 180),
    "broken": (_scripted("broken.py", BROKEN_SCRIPT, 1), ("--run-dir", "run"), 180),
    "order": (_scripted("order.py", ORDER_SCRIPT, 1), ("--run-dir", "run"), 180),
    "rewrapped": (_scripted("rewrapped.py", REWRAP_SCRIPT, 2), ("--run-dir", "run"), 180),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Future[Any]]]:
    root = tmp_path_factory.mktemp("run-cmd")
    with ThreadPoolExecutor(3) as pool:
        started: dict[str, tuple[Path, Future[Any]]] = {}
        for name, (cmd, options, timeout) in JOBS.items():
            if name == "lightning" and importlib.util.find_spec("lightning") is None:
                continue  # its test skips
            if name == "transformers" and _no_transformers():
                continue  # its test skips
            folder = root / name
            folder.mkdir()
            started[name] = (folder, pool.submit(_run_job, folder, cmd, options, timeout))
        wait([job for _, job in started.values()])  # the module's other tests run on a quiet machine
    return started


def _run_job(
    folder: Path, cmd: Callable[[Path], list[str]], options: tuple[str, ...], timeout: float
) -> subprocess.CompletedProcess[str]:
    """A job of ``JOBS``, its command line (torchrun's free port) made as it starts, not as it is
    queued: a port picked while other jobs run may be taken by their connections before this one
    binds it (EADDRINUSE). Where it was all the same, the job runs again, once, in a clean
    folder, on another port: nothing of it ran."""
    proc = ddpdoctor_run(folder, cmd(folder), *options, timeout=timeout)
    if proc.returncode != 0 and "EADDRINUSE" in proc.stderr:
        for entry in folder.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        proc = ddpdoctor_run(folder, cmd(folder), *options, timeout=timeout)
    return proc


def _job(jobs: dict[str, tuple[Path, Future[Any]]], name: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    folder, job = jobs[name]
    return folder, job.result()


def test_torchrun_script_without_ddpdoctor_is_instrumented(jobs: dict[str, tuple[Path, Future[Any]]]) -> None:
    tmp_path, proc = _job(jobs, "torchrun")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = _printed_run_dir(proc)
    assert run_dir.is_absolute() and run_dir.parent == tmp_path / "ddpdoctor-runs"
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank-00000.jsonl", "rank-00001.jsonl"]
    run = ddpdoctor.load_run(run_dir)
    assert [run.ranks[r].header.local_rank for r in (0, 1)] == [0, 1]
    assert all(len(log.steps) == 5 and log.end is not None for log in run.ranks.values())
    assert all(log.steps[-1].b_ready_us for log in run.ranks.values())  # per-bucket timing is on
    assert "final loss" in proc.stdout


def test_mp_spawn_children_are_instrumented(jobs: dict[str, tuple[Path, Future[Any]]]) -> None:
    tmp_path, proc = _job(jobs, "spawn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _printed_run_dir(proc) == tmp_path / "spawned"
    run = ddpdoctor.load_run(tmp_path / "spawned")
    assert sorted(run.ranks) == [0, 1]
    assert all(len(log.steps) == 4 for log in run.ranks.values())


def test_a_script_with_its_own_comm_hook_keeps_it_and_is_timed(jobs: dict[str, tuple[Path, Future[Any]]]) -> None:
    tmp_path, proc = _job(jobs, "comm_hook")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the user's hook reduced every bucket of every step (one bucket here) ...
    assert "rank 0 hook calls 6" in proc.stdout and "rank 1 hook calls 6" in proc.stdout
    # ... and ddpdoctor timed it
    run = ddpdoctor.load_run(tmp_path / "hooked")
    for log in run.ranks.values():
        assert len(log.steps) == 6
        assert all(s.b_done_us and s.b_done_us[0] >= s.b_ready_us[0] for s in log.steps)


def test_lightning_ddp_strategy_is_instrumented(jobs: dict[str, tuple[Path, Future[Any]]]) -> None:
    # found, not imported: importing lightning here costs seconds and the job imports it itself
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("PyTorch Lightning is not installed")
    tmp_path, proc = _job(jobs, "lightning")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = ddpdoctor.load_run(tmp_path / "lightning")
    assert sorted(run.ranks) == [0, 1]
    assert all(len(log.steps) == 5 for log in run.ranks.values())


def _no_transformers() -> str:
    """Why transformers' ``Trainer`` cannot run here ("" where it can): found, not imported (an
    import costs seconds); its releases from 5.0 on need torch 2.6."""
    import torch

    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
        return f"transformers' Trainer needs torch 2.6 or later (torch {torch.__version__})"
    return ""


def test_transformers_trainer_is_instrumented_and_told_its_own_switches(
    jobs: dict[str, tuple[Path, Future[Any]]],
) -> None:
    # the Trainer wraps the model through Accelerate with find_unused_parameters=True, and BERT
    # broadcasts two constant buffers: both named, each with the TrainingArguments switch
    if why := _no_transformers():
        pytest.skip(why)
    tmp_path, proc = _job(jobs, "transformers")
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = {line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("rank ")}
    assert len(digests) == 1, proc.stdout[-2000:]  # (two ranks printed the same parameters)
    run = ddpdoctor.load_run(tmp_path / "transformers")
    assert sorted(run.ranks) == [0, 1] and all(len(log.steps) == 8 for log in run.ranks.values())
    assert run.ranks[0].header.ddp_options["find_unused_parameters"] is True
    found = {f.code: f for f in ddpdoctor.analyze(run).findings}
    assert "TrainingArguments(ddp_find_unused_parameters=False)" in found["find-unused-unneeded"].fix
    constant = found["constant-buffers"]
    assert sorted(constant.evidence["names"]) == ["bert.embeddings.position_ids", "bert.embeddings.token_type_ids"]
    assert "TrainingArguments(ddp_broadcast_buffers=False)" in constant.fix


def test_never_instrumented_twice(jobs: dict[str, tuple[Path, Future[Any]]]) -> None:
    """A script that calls ddpdoctor.instrument itself, and one using the drop-in class."""
    tmp_path, proc = _job(jobs, "both")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    # one file per model per rank (a second attach would have opened rank-NNNNN.ddp2.jsonl)
    assert names == ["rank-00000.ddp1.jsonl", "rank-00000.jsonl", "rank-00001.ddp1.jsonl", "rank-00001.jsonl"]
    for name in names:
        assert len(_headers(tmp_path / "run" / name)) == 1


def test_a_model_rewrapped_by_hand_goes_on_in_its_log(jobs: dict[str, tuple[Path, Future[Any]]]) -> None:
    """A new DDP over the module an earlier one wraps (after unfreezing, as DDP requires) is the
    same model: its steps go on in the same file, in a header segment of their own (it used to
    open a second model's file, which the report does not read by default)."""
    tmp_path, proc = _job(jobs, "rewrapped")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    # the other model (a module of its own) keeps its own file
    assert names == ["rank-00000.ddp1.jsonl", "rank-00000.jsonl", "rank-00001.ddp1.jsonl", "rank-00001.jsonl"]
    run = ddpdoctor.load_run(tmp_path / "run")
    for log in run.ranks.values():
        reasons = [h.reason for h in _headers(tmp_path / "run" / f"rank-{log.rank:05d}.jsonl")]
        assert reasons == ["attach", "rewrap", "rewrap"]  # wrapped after each of the 2 stages
        assert [s.step for s in log.steps] == list(range(8)) and log.end is not None
        rewrapped = [header for header, _, _ in log.segments()][-1]  # the latest DDP's
        assert all(p.requires_grad for p in rewrapped.params)
        assert log.header is not None and not log.header.params[0].requires_grad  # the first's
    # and training is what it is without ddpdoctor
    plain = subprocess.run(
        torchrun_cmd(str(tmp_path / "rewrapped.py"), nproc=2), capture_output=True, text=True, timeout=180, env=_env()
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    losses = [line for line in proc.stdout.splitlines() if line.startswith("losses")]
    assert losses and losses == [line for line in plain.stdout.splitlines() if line.startswith("losses")]


def test_exit_code_is_cmds_and_a_missing_command_is_127(tmp_path: Path) -> None:
    env = _env_no_torch()
    proc = ddpdoctor_run(tmp_path, [sys.executable, "-c", "raise SystemExit(7)"], env=env)
    assert proc.returncode == 7
    # no DDP model was built: said, instead of pointing at a report of a run dir never written
    assert "CMD exited with 7 before any DistributedDataParallel model was built" in proc.stderr
    assert "report: ddpdoctor report" not in proc.stderr
    # ... also where CMD succeeded (a launcher that ran one process without a process group)
    proc = ddpdoctor_run(tmp_path, [sys.executable, "-c", "pass"], env=env)
    assert proc.returncode == 0 and "CMD exited with 0; no DistributedDataParallel model was built" in proc.stderr
    assert ddpdoctor_run(tmp_path, ["/nonexistent/ddpdoctor-test-cmd"], env=env).returncode == 127


def test_processes_that_never_import_torch_do_not_import_it_and_a_sitecustomize_still_runs(tmp_path: Path) -> None:
    own = tmp_path / "own_site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n")
    env = dict(_env_no_torch(), PYTHONPATH=str(own))
    code = (
        "import os, sys; "
        "print(sorted(m for m in ('torch', 'ddpdoctor') if m in sys.modules), os.environ.get('OWN_SITECUSTOMIZE'))"
    )
    proc = ddpdoctor_run(tmp_path, [sys.executable, "-c", code], env=env)
    assert proc.returncode == 0, proc.stderr
    assert "[] ran" in proc.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_cmd(tmp_path: Path, sig: signal.Signals) -> None:
    code = textwrap.dedent(f"""
        import signal, sys
        signal.signal({int(sig)}, lambda *a: sys.exit(42))
        print("ready", flush=True)
        signal.pause()
    """)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpdoctor", "run", "--", sys.executable, "-c", code],
        cwd=tmp_path,
        env=_env_no_torch(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        assert any(line.strip() == "ready" for line in lines)  # CMD is up and has its handler
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 42
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_an_elastic_restart_gets_its_own_attempt(tmp_path: Path) -> None:
    script = tmp_path / "flaky.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        from torch import nn
        dist.init_process_group("gloo")
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        def train():
            model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
            for step in range(3 + attempt):
                model(torch.randn(2, 4)).sum().backward()
        train()
        if attempt == 0 and dist.get_rank() == 1:
            os._exit(3)   # rank 1 fails: torchrun restarts every worker
        dist.destroy_process_group()
    """)
    )
    # torchrun's static rendezvous, and its c10d one unless told otherwise, keep one store for
    # every restart: restarted workers can then read the dead attempt's addresses and fail or
    # hang in init_process_group (with or without ddpdoctor). A store per round avoids that.
    env = dict(_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "elastic"]
    for _ in range(2):
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            *rdzv,
            str(script),
        ]
        proc = ddpdoctor_run(tmp_path, cmd, "--run-dir", "run", env=env, timeout=120)
        # torch 2.13's gloo can abort a process at exit ("terminate called without an active
        # exception"), plain torchrun too: not what this test is about, so one more try
        if "terminate called without an active exception" not in proc.stderr:
            break
    assert "note:" not in proc.stderr  # nothing to advise: restarts are set up to work
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt-0", "attempt-1"]
    latest = ddpdoctor.load_run(run_dir)  # the latest attempt by default
    assert latest.attempt == 1 and latest.attempts == [0, 1] and latest.dir == run_dir / "attempt-1"
    assert all(len(log.steps) == 4 for log in latest.ranks.values())
    first = ddpdoctor.load_run(run_dir, attempt=0)
    assert sorted(first.ranks) == [0, 1] and len(first.ranks[0].steps) == 3
    with pytest.raises(ddpdoctor.runlog.RunDirError, match="attempts here: 0, 1"):
        ddpdoctor.load_run(run_dir, attempt=5)
    # `ddpdoctor report` reads the latest attempt, or the one named by its folder
    assert (
        subprocess.run(
            [sys.executable, "-m", "ddpdoctor", "report", str(run_dir / "attempt-0")], capture_output=True, timeout=120
        ).returncode
        == 0
    )


def test_a_failing_hook_warns_once_and_training_goes_on(jobs: dict[str, tuple[Path, Future[Any]]]) -> None:
    tmp_path, proc = _job(jobs, "broken")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained" in proc.stdout
    assert proc.stderr.count("could not instrument a DistributedDataParallel model") == 1
    assert not (tmp_path / "run").exists()


def test_the_hooks_monitor_lets_the_model_go_before_the_process_group(
    jobs: dict[str, tuple[Path, Future[Any]]],
) -> None:
    """A script that drops its model and destroys the group gets that order back under `run`."""
    tmp_path, proc = _job(jobs, "order")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.index("model freed") < proc.stdout.index("group destroyed")
    log = ddpdoctor.load_run(tmp_path / "run").ranks[0]
    assert len(log.steps) == 3 and log.end is not None and log.end.reason == "close"


def test_two_nodes_sharing_a_filesystem_write_one_run(tmp_path: Path) -> None:
    """Two `ddpdoctor run -- torchrun --nnodes 2` (one per "node", same folder) give one run dir."""
    from concurrent.futures import ThreadPoolExecutor

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch import nn
        dist.init_process_group("gloo")
        def train():
            model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
            for _ in range(4):
                model(torch.randn(4, 8)).sum().backward()
        train()
        dist.destroy_process_group()
    """)
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "job42",
        str(script),
    ]
    with ThreadPoolExecutor(2) as pool:
        nodes = list(pool.map(lambda _: ddpdoctor_run(tmp_path, cmd, timeout=120), range(2)))
    for proc in nodes:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _printed_run_dir(proc) == tmp_path / "ddpdoctor-runs" / "rdzv-job42"
    run = ddpdoctor.load_run(tmp_path / "ddpdoctor-runs" / "rdzv-job42")
    assert sorted(run.ranks) == [0, 1] and all(len(log.steps) == 4 for log in run.ranks.values())
