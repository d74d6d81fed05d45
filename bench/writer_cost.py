"""What the log writer's thread costs: its CPU per step in a real run, and the compaction's.

The runtime emits a full step record at every step; the file writer's thread compacts them
(``sinks.compact.Compactor``) and encodes what the file keeps. That thread runs beside training:
on a host whose cores the ranks fill (this project's 2-core VM, two ranks), every µs of it is
taken from them. Two figures, on two gloo ranks (``torch.multiprocessing``, one CPU thread each)
training the short model of ``bench/overhead.py`` under ``ddpdoctor.instrument`` with its
defaults:

1. **In the run**: the CPU time of each of ddpdoctor's threads (the writer, the process sampler,
   the watchdog) and ``Monitor.own_ns`` on the training thread, per step, over ``--steps`` steps
   after a warm-up: the cost as it lands, with the writer's data cold between its wake-ups.
2. **In a loop**: the same run's records (kept by a second, in-memory sink) fed to a fresh
   ``Compactor`` and encoded, ``--rounds`` times, median µs per step: the code's warm cost, which
   tells a change to the compaction from the host's noise. ``--against TREE`` feeds the same
   records to another checkout's ``sinks/compact.py`` too, alternating, and checks that both
   write the same bytes.

    python bench/writer_cost.py [--steps 2000] [--rounds 7] [--against /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import free_port, init_gloo
from bench.overhead import SPECS, build_training

WORLD_SIZE = 2
WARMUP = 200


def _thread_cpu_ns() -> dict[str, int]:
    out: dict[str, int] = {}
    for t in threading.enumerate():
        if t.ident is None or not t.is_alive():
            continue
        try:
            out[t.name] = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
        except OSError:  # it ended between enumerate and here
            pass
    return out


def _compactor_module(tree: str | None) -> ModuleType:
    if tree is None:
        from ddpdoctor.sinks import compact

        return compact
    spec = importlib.util.spec_from_file_location("other_compact", Path(tree) / "ddpdoctor" / "sinks" / "compact.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compact(module: ModuleType, records: list[Any], extension: Any) -> tuple[bytes, int]:
    """The bytes the file would hold, and the ns compaction and encoding took (with the runtime's
    extension, as the run's writer has it, where the tree's compaction takes one)."""
    from ddpdoctor.events import encode_into

    compactor = module.Compactor()
    if extension is not None and hasattr(compactor, "accelerate"):
        compactor.accelerate(extension)
    out: list[Any] = []
    t0 = time.perf_counter_ns()
    for r in records:
        compactor.feed(r, out)
    compactor.drain(out)
    buf = bytearray()
    for r in out:
        encode_into(r, buf)
    return bytes(buf), time.perf_counter_ns() - t0


def _rank(rank: int, port: int, args: dict[str, Any], run_dir: str, results: Any) -> None:
    import ddpdoctor
    from ddpdoctor.events import Step
    from ddpdoctor.sinks import FileSink, MemorySink, Sink

    class Both(Sink):
        """The file sink the defaults give, and a copy of every record for the loop (put in the
        monitor's place after ``instrument``: a sink handed to it would count as the user's, and
        get its records with list columns)."""

        def __init__(self, file: Sink) -> None:
            self.file, self.memory = file, MemorySink()

        def emit(self, record: Any) -> None:
            self.file.emit(record)
            self.memory.emit(record)

        def emit_many(self, records: Any) -> None:
            self.file.emit_many(records)
            self.memory.emit_many(records)

        def flush(self, timeout: float = 2.0) -> bool:
            return self.file.flush(timeout)

        def close(self, timeout: float = 5.0) -> None:
            self.file.close(timeout)
            self.memory.close(timeout)

    init_gloo(rank, WORLD_SIZE, port)
    ddp, opt, loss_fn, batches = build_training(SPECS["short"], rank)
    monitor = ddpdoctor.instrument(ddp, run_dir=run_dir)
    assert isinstance(monitor.sink, FileSink), type(monitor.sink)
    sink = monitor.sink = Both(monitor.sink)
    steps = args["steps"]
    for i in range(WARMUP + steps):
        if i == WARMUP:
            cpu0, own0 = _thread_cpu_ns(), monitor.own_ns
        x, y = batches[i % len(batches)]
        loss = loss_fn(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    cpu1, own1 = _thread_cpu_ns(), monitor.own_ns
    in_run = {
        name.split(":")[0]: (cpu1[name] - cpu0.get(name, 0)) / 1e3 / steps  # (the writer's: by rank file)
        for name in cpu1
        if name.startswith("ddpdoctor") and not name.startswith("ddpdoctor-sigterm")
    }
    in_run["Monitor.own_ns (training thread)"] = (own1 - own0) / 1e3 / steps
    monitor.close()
    records = list(sink.memory.records)
    from ddpdoctor.runtime import native_hook

    extension = native_hook.choose(cuda=False)  # (the one the run loaded; None where it did not)
    n_steps = sum(isinstance(r, Step) for r in records)
    modules = {"this tree": _compactor_module(None)}
    if args["against"]:
        modules[args["against"]] = _compactor_module(args["against"])
    loop: dict[str, list[float]] = {name: [] for name in modules}
    written: dict[str, bytes] = {}
    order = list(modules.items())
    for _ in range(args["rounds"]):
        order.reverse()  # who goes first (and warms the records for the other) alternates
        for name, module in order:
            data, ns = _compact(module, records, extension)
            loop[name].append(ns / 1e3 / n_steps)
            written[name] = data
    results.put(
        (
            rank,
            {
                "in_run": in_run,
                "loop": {name: statistics.median(v) for name, v in loop.items()},
                "same_bytes": len(set(written.values())) == 1,
                "bytes_per_step": len(written["this tree"]) / n_steps,
            },
        )
    )
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--against", default=None, help="another checkout whose compaction to time beside")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-writer-") as run_dir:
        shared = {"steps": args.steps, "rounds": args.rounds, "against": args.against}
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, shared, run_dir, results)) for r in range(WORLD_SIZE)]
        try:
            for p in procs:
                p.start()
            got = dict(results.get(timeout=1800) for _ in procs)
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
    print(f"short model, 2 gloo ranks, {args.steps} steps after {WARMUP}; torch {torch.__version__}")
    print("In the run, µs of CPU per step (rank 0, rank 1):")
    for name in got[0]["in_run"]:
        print(f"  {name:45s} {got[0]['in_run'][name]:7.1f} {got[1]['in_run'].get(name, float('nan')):7.1f}")
    print(f"In a loop over the run's records, compaction and encoding, median of {args.rounds}, µs per step:")
    for name in got[0]["loop"]:
        print(f"  {name:45s} {got[0]['loop'][name]:7.2f} {got[1]['loop'][name]:7.2f}")
    same = all(g["same_bytes"] for g in got.values())
    print(
        f"  bytes a step: {got[0]['bytes_per_step']:.0f}, {got[1]['bytes_per_step']:.0f}"
        + (f"; the same bytes as {args.against}: {'yes' if same else 'NO'}" if args.against else "")
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
