"""``ddpdoctor run [--run-dir DIR] [--endpoint HOST:PORT] [--metrics HOST:PORT] [--hang-timeout S] -- CMD...``.

Runs CMD with every DDP model of every Python process it starts instrumented, no code change:
the settings go into the environment, and ``ddpdoctor/autoload/site`` goes first on
``PYTHONPATH``, whose ``sitecustomize`` patches ``DistributedDataParallel`` when torch loads it.
The exit code is CMD's (128 + N when CMD died of signal N); SIGINT and SIGTERM sent to this
process are passed on to CMD. ``--metrics`` serves this node's ranks for Prometheus (and relays
them to ``--endpoint`` over one connection): ``cli.node_stream``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ddpdoctor.native_cache as native_cache
from ddpdoctor.autoload import SITE_DIR
from ddpdoctor.cli import torchrun_args
from ddpdoctor.events import environment
from ddpdoctor.events.layout import (
    ATTEMPT_PREFIX,
    DEFAULT_ROOT,
    ENDPOINT_ENV,
    HANG_TIMEOUT_ENV,
    RANK_FILE_PREFIX,
    RANK_FILE_SUFFIX,
    RUN_DIR_ENV,
    new_run_name,
)
from ddpdoctor.events.wire import parse_endpoint

_FORWARDED = (signal.SIGINT, signal.SIGTERM)
#: si_code of a signal the kernel generated (e.g. Ctrl-C on the terminal): it reached CMD too.
_SI_KERNEL = 0x80


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run a training command with every DDP model instrumented, no code change",
        description="Run CMD (e.g. torchrun ... train.py) with every DistributedDataParallel model "
        "in every Python process it starts instrumented.",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="where the ranks write (default: ddpdoctor-runs/<time>-<id>); on several nodes give "
        "every node the same dir on a shared filesystem",
    )
    p.add_argument(
        "--endpoint",
        default=None,
        metavar="HOST:PORT",
        help="also stream every rank's records to `ddpdoctor watch --listen` or `ddpdoctor collect`",
    )
    p.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help="serve this node's ranks for Prometheus on http://HOST:PORT/metrics (one per node: the ranks "
        "stream to this process on loopback; with --endpoint it relays them there over one connection)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds without progress before the hang watchdog records where each rank is",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command to run")
    p.set_defaults(func=run)


def child_env(
    run_dir: Path, endpoint: str | None, hang_timeout: float | None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment CMD runs in: the hook first on PYTHONPATH, the settings in variables."""
    env = dict(os.environ if base is None else base)
    paths = [str(SITE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[RUN_DIR_ENV] = str(run_dir)
    if endpoint:
        env[ENDPOINT_ENV] = endpoint
    if hang_timeout is not None:
        env[HANG_TIMEOUT_ENV] = repr(float(hang_timeout))
    return env


#: ``0`` turns the native comm hook off (read by ``ddpdoctor.runtime.step.native_hook``).
NATIVE_ENV = environment.NATIVE_ENV
#: Longest a first build may take before the ranks start without it.
NATIVE_BUILD_TIMEOUT_S = 900.0


def prepare_native(env: dict[str, str], prefix: str, gpu_skips: bool = False) -> None:
    """Build ddpdoctor's native comm hook before any rank starts, so the ranks only load it.

    The build (~30 s, once per torch version, then cached) runs in a child process of this
    launcher, which has no torch imported. A cached build is found without that child (whose
    torch import took 2.5 s of every launch). When it cannot be built, ``env`` gets
    ``DDPDOCTOR_NATIVE=0``: the ranks take the Python comm hook at once instead of each trying
    to build. Says so in one line; never fails the run.

    ``gpu_skips``: on a host with a visible GPU, build nothing. A job there trains on the GPU, whose
    buckets the Python route times with CUDA events, and a first build held such a job 36 s (an
    H200 host's 16 cores) for nothing; a CPU job there builds it in its ranks on first use.
    """
    if env.get(NATIVE_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return
    if gpu_skips and native_cache.gpu_visible(env):
        return
    if native_cache.cached_build() is not None:
        return
    started = time.monotonic()
    why = ""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ddpdoctor.runtime.native"],
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=NATIVE_BUILD_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            why = lines[-1] if lines else f"exit {proc.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    took = time.monotonic() - started
    if why:
        env[NATIVE_ENV] = "0"
        print(
            f"{prefix}: warning: {why}; per-bucket timing uses the Python comm hook",
            file=sys.stderr,
            flush=True,
        )
    elif took > 5.0:
        print(f"{prefix}: built the native comm hook in {took:.0f} s (once per torch version)", flush=True)


def _new_run_dir() -> Path:
    return Path(DEFAULT_ROOT) / new_run_name()


def _default_run_dir(torchrun: torchrun_args.TorchrunArgs | None) -> Path:
    """A fresh run dir; for torchrun on several nodes, one every node names alike when it can."""
    if torchrun is None or torchrun.max_nodes <= 1:
        return _new_run_dir()
    name = torchrun_args.shared_run_name(torchrun)
    if name is None:
        why = (
            f"torchrun may span {torchrun.max_nodes} nodes (--nnodes {torchrun.nnodes}) and without --rdzv-id "
            "this node names its run dir alone"
        )
    else:
        run_dir = Path(DEFAULT_ROOT) / name
        # Nodes wait for each other in the rendezvous before any rank writes, so a non-empty
        # folder here is an earlier job with the same --rdzv-id: never append to it.
        if not (run_dir.is_dir() and any(run_dir.iterdir())):
            return run_dir
        why = f"{run_dir} already holds a run of --rdzv-id {torchrun.rdzv_id!r}"
    print(
        f"ddpdoctor run: warning: {why}; give every node the same --run-dir on a shared filesystem to get one run",
        file=sys.stderr,
        flush=True,
    )
    return _new_run_dir()


def _recorded(run_dir: Path) -> bool:
    """Whether some rank wrote a file in ``run_dir`` (or in an elastic attempt's folder of it)."""
    try:
        rank_files = f"{RANK_FILE_PREFIX}*{RANK_FILE_SUFFIX}"
        return any(run_dir.glob(rank_files)) or any(run_dir.glob(f"{ATTEMPT_PREFIX}*/{rank_files}"))
    except OSError:
        return True  # unreadable here (another node's filesystem): say where the report is, as before


def _check_endpoint(endpoint: str) -> None:
    try:
        parse_endpoint(endpoint, what="--endpoint")
    except ValueError as exc:
        raise SystemExit(f"ddpdoctor run: {exc}") from None


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("ddpdoctor run: no command given (usage: ddpdoctor run [options] -- CMD...)", file=sys.stderr)
        return 2
    if args.endpoint:
        _check_endpoint(args.endpoint)
    torchrun = torchrun_args.parse(cmd)
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = _default_run_dir(torchrun)
    run_dir = run_dir.absolute()  # absolute: CMD may change directory
    node = None
    if args.metrics:
        from ddpdoctor.cli.node_stream import NodeStream  # (sockets and the analysis only when asked)

        try:
            node = NodeStream(args.metrics, args.endpoint)
        except (ValueError, OSError) as exc:
            print(f"ddpdoctor run: --metrics: {exc}", file=sys.stderr)
            return 2
    env = child_env(run_dir, node.endpoint if node is not None else args.endpoint, args.hang_timeout)
    print(f"ddpdoctor run: run dir {run_dir}", flush=True)
    if node is not None:
        print(f"ddpdoctor run: this node's ranks for Prometheus on {node.metrics.url}", flush=True)
    for advice in (torchrun_args.restart_advice(torchrun), torchrun_args.port_advice(torchrun)) if torchrun else ():
        if advice:
            print(f"ddpdoctor run: note: {advice}", file=sys.stderr, flush=True)
    if args.endpoint:
        print(f"ddpdoctor run: streaming to {args.endpoint}", flush=True)
    prepare_native(env, "ddpdoctor run", gpu_skips=True)
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        print(f"ddpdoctor run: cannot start {cmd[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        if node is not None:
            node.close()
        return 127 if isinstance(exc, FileNotFoundError) else 126
    _forward_signals(proc)
    code = proc.wait()
    if node is not None:
        print(f"ddpdoctor run: {node.close()}", flush=True)
    if _recorded(run_dir):
        print(f"ddpdoctor run: CMD exited with {code}; report: ddpdoctor report {run_dir}", file=sys.stderr, flush=True)
    elif code != 0:
        print(
            f"ddpdoctor run: CMD exited with {code} before any DistributedDataParallel model was built: "
            f"nothing was recorded in {run_dir}",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"ddpdoctor run: CMD exited with {code}; no DistributedDataParallel model was built, so nothing "
            f"was recorded in {run_dir} (a launcher that ran one process without a process group builds "
            "none)",
            file=sys.stderr,
            flush=True,
        )
    return 128 - code if code < 0 else code


def _forward_signals(proc: subprocess.Popen[bytes]) -> None:
    """Pass SIGINT/SIGTERM on to CMD, except what the terminal already sent it.

    Signals are blocked here and taken by a thread with ``sigwaitinfo``, which tells who sent
    them: Ctrl-C on the terminal reaches the whole foreground process group (CMD included), so
    passing it on would make torchrun see two interrupts; a ``kill`` aimed at this process only
    is passed on. CMD was started before the mask changed, so it keeps the default mask.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)

    def forward() -> None:
        while proc.poll() is None:
            info = signal.sigwaitinfo(_FORWARDED)
            if info.si_code == _SI_KERNEL:
                continue
            try:
                proc.send_signal(info.si_signo)
            except OSError:
                return

    threading.Thread(target=forward, name="ddpdoctor-run-signals", daemon=True).start()
