"""When a sampled step's fingerprint is taken: after DDP's buffer broadcast, and without a hook
where there is nothing to broadcast.

Where DDP broadcasts buffers at every forward, the fingerprint is taken by a one-shot forward
pre-hook on the wrapped module (the buffers as the module will read them). Where it broadcasts
nothing (a model without buffers, ``broadcast_buffers=False``), the fingerprint is the same taken
at once, in DDP's own forward pre-hook, and no hook is registered for it: torch's registration
runs cold once a sample and cost more than a small model's fingerprint. Real 2-rank gloo runs of
each kind: the fingerprints are there at every sampled step, said to be before or after the
broadcast as they are, equal across ranks, and hooks on the wrapped module are registered only
where DDP broadcasts.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.categories import ProbeDisabledWarning
from ddpdoctor.events import Fingerprint, ProbeOff
from ddpdoctor.runtime import torch_compat
from ddpdoctor.sinks.memory import MemorySink
from tests.ddp_harness import run_ranks

pytestmark = pytest.mark.torch_compat

SAMPLED = [0, 1, 3, 7, 15]


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "plain":
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _train(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    ddp = DDP(_model(kind), **(torch_compat.buffer_sync_kwargs(False) if kind == "bn-no-broadcast" else {}))
    registered = [0]
    register = ddp.module.register_forward_pre_hook

    def counting(*args: Any, **kwargs: Any) -> Any:
        registered[0] += 1
        return register(*args, **kwargs)

    ddp.module.register_forward_pre_hook = counting  # type: ignore[method-assign]
    sink = MemorySink()
    monitor = ddpdoctor.instrument(ddp, sink=sink, check_every=32, proc_interval=3600.0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(10 + rank)  # each rank its own data: its own BatchNorm statistics
    for _ in range(20):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    monitor.close()
    prints = [r for r in sink.records if isinstance(r, Fingerprint) and not r.final]
    return {
        "registered": registered[0],
        "steps": [p.step for p in prints],
        "after_broadcast": {p.after_broadcast for p in prints},
        "param_bits": [p.param_bits for p in prints],
        "buffer_bits": [p.buffer_bits for p in prints],
    }


def _both(kind: str) -> list[dict[str, Any]]:
    return run_ranks(_train, world_size=2, args=(kind,), timeout=240)


def test_a_model_without_buffers_is_fingerprinted_without_a_hook() -> None:
    ranks = _both("plain")
    for r in ranks:
        assert r["registered"] == 0
        assert r["steps"] == SAMPLED and r["after_broadcast"] == {False}
    assert ranks[0]["param_bits"] == ranks[1]["param_bits"]  # replicas: equal, step for step


def test_broadcast_buffers_are_fingerprinted_after_the_broadcast() -> None:
    ranks = _both("bn")
    for r in ranks:
        assert r["registered"] == len(SAMPLED)  # a one-shot hook a sample
        assert r["steps"] == SAMPLED and r["after_broadcast"] == {True}
    # taken after the broadcast: rank 0's statistics on both ranks, though each trains on its own data
    assert ranks[0]["buffer_bits"] == ranks[1]["buffer_bits"]
    assert ranks[0]["param_bits"] == ranks[1]["param_bits"]


def test_buffers_not_broadcast_are_each_ranks_own() -> None:
    ranks = _both("bn-no-broadcast")
    for r in ranks:
        assert r["registered"] == 0
        assert r["steps"] == SAMPLED and r["after_broadcast"] == {False}
    # nothing broadcast: each rank's own statistics, from its own data
    assert ranks[0]["buffer_bits"] != ranks[1]["buffer_bits"]
    assert ranks[0]["param_bits"] == ranks[1]["param_bits"]


def _failing(rank: int, world_size: int) -> dict[str, Any]:
    """The broadcast model, its fingerprint made to fail (as ``tensor_values`` does on a buffer
    it cannot convert to float), beside the same model plain: the same losses, step for step."""
    losses: dict[str, list[float]] = {}
    out: dict[str, Any] = {}
    for instrumented in (False, True):
        ddp = DDP(_model("bn"))
        sink = MemorySink()
        monitor = None
        if instrumented:
            monitor = ddpdoctor.instrument(ddp, sink=sink, check_every=32, proc_interval=3600.0)

            def refuse(*_: Any) -> None:
                raise RuntimeError("this buffer cannot be read as float")

            monitor.checks.fingerprinter.take = refuse  # type: ignore[method-assign]
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        torch.manual_seed(10 + rank)
        seen = losses.setdefault("ddpdoctor" if instrumented else "plain", [])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(20):
                x, y = torch.randn(8, 16), torch.randn(8, 4)
                opt.zero_grad()
                loss = ((ddp(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                seen.append(float(loss))
        if monitor is not None:
            monitor.close()
            out["probes_off"] = [r.probe for r in sink.records if isinstance(r, ProbeOff)]
            out["warned"] = any(issubclass(w.category, ProbeDisabledWarning) for w in caught)
            out["checks_on"] = monitor.probes.on["checks"]
            out["steps"] = monitor.steps
    out["same_losses"] = losses["plain"] == losses["ddpdoctor"]
    return out


def test_a_fingerprint_failing_in_its_hook_switches_the_checks_off_and_training_goes_on() -> None:
    for r in run_ranks(_failing, world_size=2, timeout=240):
        assert r["same_losses"] and r["steps"] >= 19
        assert r["probes_off"] == ["checks"] and r["warned"] and not r["checks_on"]
