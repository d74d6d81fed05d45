"""``ddpdoctor demo``: a real multi-process gloo DDP training on CPU, instrumented."""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

from ddpdoctor.analysis import analyze
from ddpdoctor.cli.render_text import render
from ddpdoctor.runlog import load_run

SCENARIOS = ["healthy"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="train a small model on N gloo ranks on CPU, instrumented")
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (processes), default 2")
    p.add_argument("--steps", type=int, default=60, help="training steps, default 60")
    p.add_argument("--run-dir", type=Path, help="where the logs go (default: ddpdoctor-runs/demo-<time>)")
    p.add_argument("--scenario", choices=SCENARIOS, default="healthy")
    p.add_argument("--headless", action="store_true", help="no live view: train, then print the report")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.set_defaults(func=run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        print("ddpdoctor demo: --ranks must be at least 1", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    from ddpdoctor.cli.demo_training import DemoConfig, train_rank

    run_dir = args.run_dir or Path("ddpdoctor-runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    if not args.headless:
        print("ddpdoctor demo: the live view is not available yet; running headless", file=sys.stderr)
    print(f"run dir: {run_dir}", flush=True)
    config = DemoConfig(world_size=args.ranks, steps=args.steps, run_dir=str(run_dir), port=free_port(),
                        scenario=args.scenario)
    started = time.monotonic()
    context = mp.start_processes(train_rank, args=(config,), nprocs=args.ranks, join=False, start_method="spawn")
    try:
        deadline = started + args.timeout
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                print(f"ddpdoctor demo: timed out after {args.timeout:.0f} s", file=sys.stderr)
                return 1
    except mp.ProcessRaisedException as exc:
        print(f"ddpdoctor demo: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        print(f"ddpdoctor demo: a rank died: {exc}", file=sys.stderr)
        return 1
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    print(f"trained {args.steps} steps on {args.ranks} ranks in {time.monotonic() - started:.1f} s\n")
    sys.stdout.write(render(analyze(load_run(run_dir))))
    return 0
