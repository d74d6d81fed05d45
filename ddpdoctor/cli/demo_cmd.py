"""``ddpdoctor demo``: a real multi-process gloo DDP training on CPU, instrumented."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from ddpdoctor.analysis import analyze
from ddpdoctor.cli.ports import free_port
from ddpdoctor.cli.render_text import render
from ddpdoctor.cli.run_cmd import prepare_native
from ddpdoctor.events.layout import DEFAULT_ROOT
from ddpdoctor.runlog import load_run

SCENARIOS = ["healthy", "straggler"]
#: Steps and pacing with the live view: long and slow enough to watch (headless: quick).
LIVE_STEPS = 400
LIVE_PACE_S = 0.05


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="train a small model on N gloo ranks on CPU, instrumented")
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (processes), default 2")
    p.add_argument("--steps", type=int, help=f"training steps, default 60 headless, {LIVE_STEPS} with the live view")
    p.add_argument("--run-dir", type=Path, help="where the logs go (default: ddpdoctor-runs/demo-<time>)")
    p.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="healthy",
        help="healthy, or straggler: the last rank's backward is slower",
    )
    p.add_argument("--headless", action="store_true", help="no live view: train, then print the report")
    p.add_argument(
        "--pace",
        type=float,
        help=f"seconds to pause before each step (default {LIVE_PACE_S} with the live view, 0 headless)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.set_defaults(func=run)


#: What torch warns at import when numpy is not installed (the demo never uses numpy).
NUMPY_WARNING = "Failed to initialize NumPy"


def quiet_numpy_warning() -> None:
    """Hide torch's "Failed to initialize NumPy" warning, in this process and in the spawned ranks.

    torch prints it at import when numpy is absent, which a new user reads as the demo failing;
    the demo never touches numpy, so depending on numpy (tens of MB) to silence it would be
    wrong. The ranks import torch while unpickling their entry point, before any of ddpdoctor's
    code runs there, so the filter travels as ``PYTHONWARNINGS`` (read at interpreter start).
    Only that one message is filtered.
    """
    warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
    spec = f"ignore:{NUMPY_WARNING}:UserWarning"
    current = os.environ.get("PYTHONWARNINGS", "")
    if spec not in current:
        os.environ["PYTHONWARNINGS"] = f"{current},{spec}" if current else spec


def run(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        print("ddpdoctor demo: --ranks must be at least 1", file=sys.stderr)
        return 2
    quiet_numpy_warning()
    # the one-time build of the native comm hook is paid here, not by the ranks (which inherit
    # DDPDOCTOR_NATIVE=0 when it cannot be built)
    env = dict(os.environ)
    prepare_native(env, "ddpdoctor demo")
    os.environ.update(env)
    import torch.multiprocessing as mp

    from ddpdoctor.cli.demo_training import DemoConfig, train_rank

    live = not args.headless
    steps = args.steps if args.steps is not None else (LIVE_STEPS if live else 60)
    pace = args.pace if args.pace is not None else (LIVE_PACE_S if live else 0.0)
    run_dir = args.run_dir or Path(DEFAULT_ROOT) / time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"run dir: {run_dir}", flush=True)
    config = DemoConfig(
        world_size=args.ranks,
        steps=steps,
        run_dir=str(run_dir),
        port=free_port(),
        scenario=args.scenario,
        pace_s=pace,
        output=str(run_dir / "demo-output.txt") if live else None,
    )
    started = time.monotonic()
    context = mp.start_processes(train_rank, args=(config,), nprocs=args.ranks, join=False, start_method="spawn")
    try:
        if live:
            return _watch(context, run_dir, steps, args.ranks)
        return _wait(context, started, args.timeout, steps, args.ranks, run_dir)
    finally:
        _stop(context)


def _wait(context: Any, started: float, timeout: float, steps: int, ranks: int, run_dir: Path) -> int:
    import torch.multiprocessing as mp

    try:
        deadline = started + timeout
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                print(f"ddpdoctor demo: timed out after {timeout:.0f} s", file=sys.stderr)
                return 1
    except mp.ProcessRaisedException as exc:
        print(f"ddpdoctor demo: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        print(f"ddpdoctor demo: a rank died: {exc}", file=sys.stderr)
        return 1
    print(f"trained {steps} steps on {ranks} ranks in {time.monotonic() - started:.1f} s\n")
    sys.stdout.write(render(analyze(load_run(run_dir))))
    return 0


def _watch(context: Any, run_dir: Path, steps: int, ranks: int) -> int:
    """The live view over the training; when the user quits, stop the ranks and print the report."""
    from ddpdoctor_tui import WatchApp  # textual only when the UI is actually wanted

    WatchApp(run_dir).run()
    running = any(p.is_alive() for p in context.processes)
    _stop(context)
    if running:
        print(f"stopped the training on your quit (it was set for {steps} steps)")
    failed = [r for r, p in enumerate(context.processes) if p.exitcode not in (0, None) and not running]
    if failed:
        print(
            f"ddpdoctor demo: ranks {failed} failed; their output is in {run_dir / 'demo-output.txt'}", file=sys.stderr
        )
    sys.stdout.write("\n" + render(analyze(load_run(run_dir))))
    return 1 if failed else 0


def _stop(context: Any, grace_s: float = 3.0) -> None:
    """SIGTERM first (each rank's monitor flushes its log on it), then SIGKILL what is left."""
    alive = [p for p in context.processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(5)
