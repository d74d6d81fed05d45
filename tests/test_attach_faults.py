"""The attach transaction: a failure at any step leaves DDP exactly as it was (same hooks, still
averaging gradients across real gloo ranks, no thread left, nothing registered), and says which
step failed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.runtime.attach import STEPS
from tests.ddp_harness import run_ranks
from tests.runtime_workers import attach_fault_checks

pytestmark = pytest.mark.torch_compat

#: Steps that run only when a comm hook was registered before instrument (the reducer is rebuilt).
REBUILD_ONLY = {"rebuild_reducer", "retire_old_reducer"}


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(attach_fault_checks, 2, args=(str(tmp_path_factory.mktemp("faults")),), timeout=240)


@pytest.mark.parametrize("hook_first", [False, True], ids=["default-hook", "hook-registered-first"])
@pytest.mark.parametrize("step", STEPS)
def test_a_failed_attach_step_leaves_ddp_as_it_was(faults: list[dict[str, Any]], step: str, hook_first: bool) -> None:
    for rank_result in faults:
        reference = rank_result[f"plain-{hook_first}"]
        r = rank_result[f"{step}-{hook_first}"]
        assert r["replicas_equal"], "gradients were not averaged after the failed attach"
        assert r["sums"] == reference["sums"]  # trains bit for bit as with a successful attach
        if step in REBUILD_ONLY and not hook_first:
            assert not r["disabled"]  # that step does not exist on this path: attach succeeded
            continue
        assert r["disabled"] and not r["registered"]
        assert r["surface_same"], "DDP's hooks or attributes changed"
        assert r["new_threads"] == []
        assert any(f"attach step '{step}' failed" in w and "injected failure" in w for w in r["warnings"]), r[
            "warnings"
        ]


def test_every_attach_step_is_covered() -> None:
    assert STEPS[0] == "validate" and STEPS[-1] == "retire_old_reducer" and len(set(STEPS)) == len(STEPS) == 11


def test_rewrap_with_a_mistyped_override_raises_before_touching_the_model(tmp_path: Path) -> None:
    from tests.runtime_workers import rewrap_typo_check

    for r in run_ranks(rewrap_typo_check, 2, args=(str(tmp_path),), timeout=120):
        assert "find_unused_paramters" in r["error"]
        assert r["replicas_equal"] and r["still_monitored"]


def shadowed_worker(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    """A ``_sync_buffers`` another tool set on the instance before ddpdoctor attached."""
    import torch
    from torch import nn

    import ddpdoctor

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []
    own = model._sync_buffers

    def counted() -> Any:
        calls.append(1)
        return own()

    def train(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 8)).sum().backward()
            opt.step()

    model.__dict__["_sync_buffers"] = counted
    mon = ddpdoctor.instrument(model, run_dir)
    train(4)
    during = len(calls)
    mon.close()
    restored = model.__dict__.get("_sync_buffers") is counted
    train(1)
    sums = [float(b.sum()) for b in model.module.buffers() if b.is_floating_point()]
    return {"during": during, "after": len(calls) - during, "restored": restored, "sums": sums}


def test_a_sync_buffers_set_on_the_instance_before_is_timed_then_put_back(tmp_path: Path) -> None:
    """ddpdoctor's shadow of DDP's buffer broadcast calls the one another tool set on the instance
    (not DDP's method under it), times it, and puts it back when the monitor closes."""
    import ddpdoctor

    results = run_ranks(shadowed_worker, 2, args=(str(tmp_path),), timeout=120)
    for r in results:
        assert r["during"] == 4  # one broadcast a training forward, through the other tool's wrapper
        assert r["restored"] and r["after"] == 1
    assert results[0]["sums"] == results[1]["sums"]  # the last forward broadcast rank 0's buffers
    for log in ddpdoctor.load_run(tmp_path).ranks.values():
        assert [s.step for s in log.steps] == [0, 1, 2, 3]
        assert all(s.bcast_us is not None for s in log.steps)
