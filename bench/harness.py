"""What the benches share: a free port, a gloo process group per rank, process groups that take
turns (interleaved rounds), the statistics of paired rounds, and the minimal Python comm hook
(the attribution rows' floor). Each bench file holds its own workload; the tests use the same
``free_port`` (``ddpdoctor.cli.ports``, also the demo's).

On a machine whose CPU capacity changes from one few-second stretch to the next, a comparison is
only fair when its two sides run interleaved in short rounds: ``rotated`` and ``pair_roles``
give every pair its own order, ``paired_overheads`` compares each round with its partner.
"""

from __future__ import annotations

import contextlib
import os
import queue
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from ddpdoctor.cli.ports import free_port

__all__ = [
    "Groups",
    "RankFailure",
    "free_port",
    "init_gloo",
    "pair_roles",
    "python_allreduce_hook",
    "paired_overheads",
    "pct",
    "quantile",
    "rotated",
]

T = TypeVar("T")


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 300.0) -> None:
    """Join a gloo process group on loopback, one CPU thread per rank (the benches' setting)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def first_value(fut: Any) -> Any:
    """An all-reduce future's callback: its one tensor (a comm hook's future must hold the bucket)."""
    return fut.value()[0]


def python_allreduce_hook(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """The least a Python comm hook can do (what DDP does in C++ without one): the floor of any
    design that times buckets from Python. Same work as ddpdoctor's default inner hook."""
    tensor = bucket.buffer()
    tensor.div_(process_group.size())
    return process_group.allreduce([tensor]).get_future().then(first_value)


# -- process groups that take turns ------------------------------------------------------------


class RankFailure(RuntimeError):
    """A rank of a group died (its exit code, and its traceback when it sent one)."""

    def __init__(self, group: str, codes: list[int | None], detail: str = "") -> None:
        signals = {-11: "SIGSEGV", -6: "SIGABRT", -9: "SIGKILL"}
        names = [signals.get(c, str(c)) if c is not None else "running" for c in codes]
        super().__init__(f"group {group}: ranks exited with {', '.join(names)}" + (f"\n{detail}" if detail else ""))
        self.codes = codes


class Groups:
    """Process groups started side by side; the parent sends each round to one of them.

    ``target(rank, group, port, commands, done, *args)`` runs in each spawned rank: it puts
    ``("ready", group, rank, info)`` on ``done`` once set up, then takes round entries from its
    ``commands`` queue until None, answering ``("result", group, rank, payload)`` (rank 0), or
    ``("error", group, rank, traceback)``. Only one group runs a round at a time; the others
    block on their queue (idle).
    """

    def __init__(self, target: Callable[..., None], world_size: int) -> None:
        import torch.multiprocessing as mp

        self.target = target
        self.world_size = world_size
        self.ctx = mp.get_context("spawn")
        self.done = self.ctx.Queue()
        self.procs: dict[str, list[Any]] = {}
        self.commands: dict[str, list[Any]] = {}
        self.errors: dict[str, str] = {}

    def start(self, group: str, *args: Any, env: dict[str, str | None] | None = None, timeout: float = 300.0) -> None:
        """Spawn the group's ranks with ``env`` applied to their environment (None: unset)."""
        port = free_port()
        saved = {k: os.environ.get(k) for k in env or {}}
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value  # read by the child when it starts
        try:
            self.commands[group] = [self.ctx.Queue() for _ in range(self.world_size)]
            self.procs[group] = []
            for rank in range(self.world_size):
                p = self.ctx.Process(
                    target=self.target,
                    daemon=True,
                    args=(rank, group, port, self.commands[group][rank], self.done, *args),
                )
                p.start()
                self.procs[group].append(p)
        finally:
            for key, old in saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old
        ready = 0
        while ready < self.world_size:
            kind, _ = self._wait(group, timeout)
            ready += kind == "ready"

    def run(self, group: str, entry: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One round on ``group``: its result (raises RankFailure or TimeoutError)."""
        for q in self.commands[group]:
            q.put(entry)
        while True:
            kind, payload = self._wait(group, timeout)
            if kind == "result":
                return dict(payload)

    def _wait(self, group: str, timeout: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, from_group, _rank, payload = self.done.get(timeout=0.2)
            except queue.Empty:
                kind = None
            if kind == "error":
                self.errors[from_group] = payload
                if from_group == group:
                    self._fail(group, payload)
            elif kind is not None and from_group == group:
                return kind, payload
            if any(p.exitcode is not None for p in self.procs[group]):
                self._fail(group, self.errors.get(group, ""))
            if time.monotonic() > deadline:
                self.kill(group)
                raise TimeoutError(f"group {group}: no answer within {timeout:.0f} s")

    def _fail(self, group: str, detail: str) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(p.exitcode is None for p in self.procs[group]):
            time.sleep(0.1)  # let the other rank go down too, to report both exit codes
        codes = [p.exitcode for p in self.procs[group]]
        with contextlib.suppress(queue.Empty):
            while not detail:  # a rank's traceback may still be on its way
                kind, from_group, _rank, payload = self.done.get(timeout=1.0)
                if kind == "error" and from_group == group:
                    detail = payload
        self.kill(group)
        raise RankFailure(group, codes, detail)

    def kill(self, group: str) -> None:
        for p in self.procs.pop(group, []):
            if p.is_alive():
                p.kill()
            p.join(5)
        self.commands.pop(group, None)

    def close(self, timeout: float = 30.0) -> None:
        """Tell every rank to stop, wait for them, kill what is left."""
        for qs in self.commands.values():
            for q in qs:
                q.put(None)
        deadline = time.monotonic() + timeout
        for procs in self.procs.values():
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
        for group in list(self.procs):
            self.kill(group)


# -- interleaving --------------------------------------------------------------------------------


def rotated(items: Sequence[T], pair: int) -> list[T]:
    """``items`` rotated by ``pair``: each pair starts with another one (no item always runs first)."""
    k = pair % len(items) if items else 0
    return [*items[k:], *items[:k]]


def pair_roles(pair: int, k: int) -> tuple[str, str]:
    """The order of a pair's two rounds: ("base", "tool") or the reverse, alternating."""
    return ("base", "tool") if (pair + k) % 2 == 0 else ("tool", "base")


# -- statistics ----------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile, linearly interpolated between the two nearest ranks."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def pct(x: float) -> str:
    """A ratio as a signed percentage (``+1.2%``)."""
    return f"{x * 100:+.1f}%"


def paired_overheads(base: Sequence[float], tool: Sequence[float]) -> dict[str, float]:
    """Overhead of ``tool`` rounds over their paired ``base`` rounds: tool / base - 1 per pair,
    summarized by the median (and quartiles, extremes, the count of pairs)."""
    ratios = [t / b - 1 for t, b in zip(tool, base, strict=True)]
    return {
        "overhead": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "q1": quantile(ratios, 0.25),
        "q3": quantile(ratios, 0.75),
        "pairs": len(ratios),
    }
