"""Two models, two optimizers, one process: each step's optimizer phase is its own optimizer's.

torch's optimizer hooks are process-wide, so a monitor sees every optimizer step of its process.
Its rule takes the first optimizer step after the step's backward has begun (a bucket ready):
one that steps between this model's forward and its backward (a GAN's other network, a teacher,
an EMA) belongs to another model. The Python route applies the rule as the hooks run; the native
route stamps in C++ and applies it at the next forward, to the stamps' instants, and must come
to the same answer, on its routine forward (no fall back to the full path a step).

Two real gloo ranks train a DDP model under ``ddpdoctor.instrument`` beside a second, local model
whose optimizer step takes 50 ms (a sleep: its workload, not a synchronization), stepped once
between the DDP model's forward and its backward and once after its optimizer step. And an
optimizer whose step runs another's (``ZeroRedundancyOptimizer`` steps its local optimizer, then
broadcasts the parameters): the step's optimizer phase ends where the outer step ends.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.events import Step
from ddpdoctor.runtime.step import hooks as hooks_module
from ddpdoctor.sinks.memory import MemorySink
from tests.ddp_harness import run_ranks
from tests.models import make_model
from tests.runtime_workers import BUCKET_CAP_MB

#: how long the other model's optimizer step takes (s)
SLOW_S = 0.05
STEPS = 12


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes ``SLOW_S`` longer: the other model's optimizer."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        time.sleep(SLOW_S)
        return super().step(closure)


class Outer(torch.optim.SGD):
    """An optimizer whose step runs another optimizer's step, then works ``SLOW_S`` more (as
    ``ZeroRedundancyOptimizer`` steps its local optimizer, then broadcasts the parameters)."""

    def __init__(self, params: Any, lr: float) -> None:
        params = list(params)
        super().__init__(params, lr=lr)
        self.inner = torch.optim.SGD(params, lr=lr)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = self.inner.step(closure)
        time.sleep(SLOW_S)
        return out


def _train(rank: int, world_size: int, route: str, kind: str) -> dict[str, Any]:
    full = hooks_module.StepHooks._forward_pre
    taken = [0]

    def counted(self: Any, module: Any, native: Any) -> None:
        taken[0] += 1
        full(self, module, native)

    hooks_module.StepHooks._forward_pre = counted  # type: ignore[method-assign]
    os.environ["DDPDOCTOR_NATIVE"] = "1" if route == "native" else "0"
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    sink = MemorySink()
    monitor = ddpdoctor.instrument(ddp, sink=sink)
    timing = monitor.attachment.header.timing
    opt = Outer(ddp.parameters(), lr=0.01) if kind == "nested" else torch.optim.SGD(ddp.parameters(), lr=0.01)
    other = nn.Linear(8, 8)
    other_opt = SlowSGD(other.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x, y, z = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen), torch.randn(4, 8, generator=gen)

    def other_step() -> None:
        if kind != "other":
            return
        other_opt.zero_grad()
        other(z).square().mean().backward()
        other_opt.step()

    for _ in range(STEPS):
        out = ddp(x)
        other_step()  # between this model's forward and its backward
        opt.zero_grad()
        ((out - y) ** 2).mean().backward()
        opt.step()
        other_step()  # after its optimizer step
    monitor.close()
    steps = [r for r in sink.records if isinstance(r, Step)]
    return {
        "timing": timing,
        "routine": STEPS - taken[0],
        "phases": [
            (s.step, s.bwd_end_us, s.sync_end_us, s.opt_start_us, s.opt_end_us, s.end_us)
            for s in steps
            if s.end_us is not None  # (the last step, still open at close, has no end)
        ],
    }


def _trained(route: str, kind: str) -> list[dict[str, Any]]:
    """Each rank's run, with what both tests require of it: the route asked for, every closed step
    recorded and, on the native route, most forwards routine (the other optimizer's stamps do not
    send each to the full path; the first forward, and those around the dense start's samples,
    take it)."""
    results = run_ranks(_train, 2, args=(route, kind), timeout=240)
    for r in results:
        assert r["timing"] == route
        assert len(r["phases"]) >= STEPS - 2
        if route == "native":
            assert r["routine"] >= STEPS // 2, r["routine"]
    return results


@pytest.mark.parametrize("route", ["native", "python"])
def test_a_second_models_optimizer_is_not_this_steps(route: str) -> None:
    for r in _trained(route, "other"):
        for index, bwd_end, sync_end, opt_start, opt_end, end in r["phases"]:
            # the step's own optimizer (SGD on a small model: well under SLOW_S), after its
            # backward; not the other model's, which stepped before the backward began
            assert opt_start is not None and opt_end is not None, (route, index)
            assert bwd_end is not None and sync_end is not None
            assert max(bwd_end, sync_end) <= opt_start <= opt_end <= end, (route, index)
            assert opt_end - opt_start < SLOW_S * 1e6 / 2, (route, index, opt_end - opt_start)


@pytest.mark.parametrize("route", ["native", "python"])
def test_an_optimizer_that_steps_another_is_timed_to_its_own_end(route: str) -> None:
    for r in _trained(route, "nested"):
        for index, _, sync_end, opt_start, opt_end, end in r["phases"]:
            # the outer step's end, past the inner optimizer's: its SLOW_S after the inner step is in
            assert opt_start is not None and opt_end is not None, (route, index)
            assert sync_end <= opt_start and opt_end - opt_start >= SLOW_S * 1e6, (route, index, opt_end - opt_start)
            assert opt_end <= end
