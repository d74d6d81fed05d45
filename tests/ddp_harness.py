"""Starting real multi-process gloo DDP from tests: free ports (``free_port``, shared with the demo and
the benches), timeouts, children killed."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch.multiprocessing as mp

from ddpdoctor.cli.ports import free_port

#: What the fork server imports once, before it forks the ranks: torch's import is most of a
#: rank's start-up (seconds on a busy 2-core machine), paid once per pytest run instead of once
#: per rank, and so is dynamo's, which DDP's constructor imports (1.7 CPU-s a rank, measured
#: 2026-12-06). Importing these starts no thread and initializes neither CUDA nor a process group,
#: so a forked rank starts as clean as a spawned one.
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(
    env: dict[str, str],
    cwd: str,
    fn_name: tuple[str, str],
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    args: tuple[Any, ...],
    backend: str,
) -> None:
    # A forked rank has the fork server's environment and working directory (those of the first
    # run_ranks of the pytest run): the test's own come first, as a spawned rank would have them,
    # and only then is the test's module imported (``fn`` is named, not pickled, for that).
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import importlib

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    result_path = Path(out_dir) / f"result-{rank}.pkl"
    try:
        module, qualname = fn_name
        fn: Any = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        payload: dict[str, Any] = {"ok": True, "result": result}
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises it in the test
        payload = {"ok": False, "error": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - teardown after the result is known: it must still be written
                pass
    result_path.write_bytes(pickle.dumps(payload))
    # torch 2.13's gloo process group sometimes aborts in its destructors at interpreter teardown
    # (with or without ddpdoctor): the result is on disk, so skip them.
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout: float = 180.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    The ranks use gloo unless ``backend`` says otherwise. ``fn`` must be importable
    (module-level). A rank's exception is re-raised here with its traceback; a rank still
    running after ``timeout`` seconds fails the test; every child is killed on the way out.
    Each rank is forked from a fork server that imported torch once per pytest run, with the
    caller's environment and working directory, as a spawned process would have them.
    """
    ctx = _context()
    port = free_port()
    env = dict(os.environ)
    fn_name = (fn.__module__, fn.__qualname__)
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-ranks-") as out_dir:
        procs = [
            ctx.Process(
                target=_entry,
                args=(env, os.getcwd(), fn_name, r, world_size, port, out_dir, args, backend),
                daemon=True,
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout)
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            if alive:
                raise TimeoutError(f"ranks {alive} still running after {timeout} s")
            results = []
            for r in range(world_size):
                path = Path(out_dir) / f"result-{r}.pkl"
                if not path.exists():
                    raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
                payload = pickle.loads(path.read_bytes())
                if not payload["ok"]:
                    raise RuntimeError(f"rank {r} failed:\n{payload['error']}")
                results.append(payload["result"])
            return results
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)


def torchrun_cmd(*args: str, nproc: int = 2) -> list[str]:
    """A one-node torchrun command line on 127.0.0.1 and a free port: ``args`` are the script and
    its arguments."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *args,
    ]


def run_tree(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a process session of its own (setsid); whatever it started is killed on the way out (torchrun
    starts each worker in a session of its own: the whole tree is collected, then killed)."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for child in [psutil.Process(proc.pid), *tree] if proc.poll() is None else tree:
            try:
                child.kill()
            except psutil.Error:
                pass
        proc.wait(timeout=30)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
