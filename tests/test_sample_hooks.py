"""A sampled step's per-parameter hooks leave nothing behind.

On sampled steps the checks stamp when each reduced parameter's gradient arrives (unused
parameters, the bucket what-if's ready times). Python's ``register_post_accumulate_grad_hook``
leaves a C++ caller of the tensor's (then empty) Python hooks on every parameter for good, which
takes the GIL at every later backward. Wherever the extension loads (the native route, and the
Python route a user's comm hook registered before ``instrument`` takes), its ``ParamSample`` puts
C++ hooks on the gradient accumulators and takes them off when the sample ends. Real 2-rank gloo
runs: the same unused parameters and per-parameter arrivals as the Python hooks give, and no
parameter keeps a Python hook.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ddpdoctor.runtime.step import native_hook
from tests.ddp_harness import run_ranks

pytestmark = pytest.mark.torch_compat


@pytest.fixture(scope="module")
def built() -> None:
    try:
        native_hook.build()
    except native_hook.NativeUnavailable as exc:
        pytest.skip(f"the native extension cannot be built here: {exc}")


class _Branchy(nn.Module):
    """``spare`` never gets a gradient; ``head`` gets one only on even steps' inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.other = nn.Linear(16, 4)
        self.spare = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_head: bool = True) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head(h) if use_head else self.other(h)


def _run(rank: int, native: bool, user_hook: bool = False) -> dict[str, Any]:
    import os

    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpdoctor
    from ddpdoctor.events import Unused
    from ddpdoctor.sinks.memory import MemorySink

    os.environ["DDPDOCTOR_NATIVE"] = "1" if native else "0"
    torch.manual_seed(0)
    ddp = DDP(_Branchy(), find_unused_parameters=True)
    if user_hook:  # registered before instrument: the Python comm hook times it
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    sink = MemorySink()
    monitor = ddpdoctor.instrument(ddp, sink=sink, check_every=2)
    timing = monitor.attachment.header.timing
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    left: list[list[str]] = []
    for step in range(6):
        if step == 4:  # frozen from a sampled step on: no longer hooked, so not called unused
            ddp.module.body.bias.requires_grad_(False)
        x = torch.randn(8, 16, generator=gen)
        ddp(x, use_head=step % 2 == 0).sum().backward()
        opt.step()
        opt.zero_grad()
        if monitor.checks.sample is None:  # between samples: what the parameters still carry
            left.append([n for n, p in ddp.module.named_parameters() if p._post_accumulate_grad_hooks is not None])
    monitor.close()
    unused = [r for r in sink.records if isinstance(r, Unused)]
    return {
        "timing": timing,
        "built_in_cpp": monitor.recorder.build_step is not None,
        "unused": {r.step: sorted(r.names) for r in unused},
        "arrived": {r.step: [t is not None for t in r.param_ready_us] for r in unused},
        "left": left,
    }


def _asked_midway(rank: int) -> list[bool]:
    """Native route, a sample every 2 steps; ``torch._dynamo.config.compiled_autograd`` set after
    step 5: per step, whether a parameter carries a Python hook between samples (the sample's
    arrivals then come from Python hooks, which compiled autograd knows)."""
    import os

    import torch._dynamo.config as dynamo_config
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpdoctor
    from ddpdoctor.sinks.memory import MemorySink

    os.environ["DDPDOCTOR_NATIVE"] = "1"
    torch.manual_seed(0)
    ddp = DDP(_Branchy(), find_unused_parameters=True)
    monitor = ddpdoctor.instrument(ddp, sink=MemorySink(), check_every=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    hooked: list[bool] = []
    try:
        for step in range(6 + native_hook.CONFIG_EVERY + 6):
            if step == 6:
                dynamo_config.compiled_autograd = True  # asked for; nothing is compiled here
            ddp(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            hooked.append(any(p._post_accumulate_grad_hooks is not None for p in ddp.parameters()))
    finally:
        dynamo_config.compiled_autograd = False
        monitor.close()
    return hooked


def _both_routes(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "native": _run(rank, True),
        "python": _run(rank, False),
        "user_hook": _run(rank, True, user_hook=True),
        "asked": _asked_midway(rank),
    }


def test_a_sample_leaves_no_hook_and_sees_what_python_hooks_see(built: None) -> None:
    for r in run_ranks(_both_routes, 2, timeout=240):
        native, python = r["native"], r["python"]
        assert native["timing"] == "native" and python["timing"] == "python"
        # sampled steps 0, 1, 2, 3, 4 (dense start, every 2): even steps use head, odd use other
        assert sorted(native["unused"]) == [0, 1, 2, 3, 4]
        for step, names in native["unused"].items():
            expected = ["other.bias", "other.weight", "spare.bias", "spare.weight"]
            if step % 2:
                expected = ["head.bias", "head.weight", "spare.bias", "spare.weight"]
            assert names == expected, (step, names)
        assert native["unused"] == python["unused"]
        assert native["arrived"] == python["arrived"]
        # the native sample takes its hooks off (the Python route's hooks leave a C++ caller of
        # an empty dict on each parameter they were put on: torch keeps it)
        assert native["left"] and all(names == [] for names in native["left"])
        # a user's hook registered before instrument: the Python route times the buckets, the
        # extension still serves the samples and the step records
        with_hook = r["user_hook"]
        assert with_hook["timing"] == "python" and with_hook["built_in_cpp"] and native["built_in_cpp"]
        assert with_hook["unused"] == native["unused"] and with_hook["arrived"] == native["arrived"]
        assert with_hook["left"] and all(names == [] for names in with_hook["left"])
        assert not python["built_in_cpp"]  # DDPDOCTOR_NATIVE=0: no extension at all
        # body.bias frozen at step 4: not hooked, so not unused (the hooked parameters follow
        # requires_grad from one sample to the next), and no gradient seen
        assert not native["arrived"][4][1] and native["arrived"][2][1]
        # compiled autograd asked for midway: C++ arrival hooks until then, Python ones at the
        # latest CONFIG_EVERY forwards later (the config is read that often on the routine path)
        asked = r["asked"]
        assert not any(asked[:6]), asked
        assert any(asked[6 : 6 + native_hook.CONFIG_EVERY + 4]), asked
