"""``copy.deepcopy`` and ``torch.save``/``torch.load`` of an instrumented DDP work as on plain DDP.

The copy is a plain, uninstrumented DDP that trains (its gradients averaged across the real gloo
ranks); the original keeps its monitor, whose log keeps getting steps. The four cases run one
after another on one pair of gloo ranks (one process group), each with its own DDP and run dir.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest

from tests.ddp_harness import run_ranks

pytestmark = pytest.mark.torch_compat

STEPS_BEFORE, STEPS_AFTER, COPY_STEPS = 3, 3, 3


def _net() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: Any, rank: int, steps: int, seed: int) -> None:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed * 100 + rank)  # different data on every rank
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 8, generator=gen)).pow(2).mean().backward()
        opt.step()


def _flat(model: Any) -> Any:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def copy_worker(rank: int, world_size: int, run_dir: str, how: str, check_every: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpdoctor
    from ddpdoctor.runtime.attach import SHADOWED, monitor_of

    plain_hooks = len(DDP(_net())._forward_pre_hooks)  # what a plain DDP carries itself
    ddp = DDP(_net())
    mon = ddpdoctor.instrument(ddp, run_dir, check_every=check_every)
    _train(ddp, rank, STEPS_BEFORE, seed=1)
    if how == "deepcopy":
        twin = copy.deepcopy(ddp)
    else:
        buf = io.BytesIO()
        torch.save(ddp, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert type(twin) is DDP
    assert monitor_of(twin) is None and monitor_of(ddp) is mon
    leftovers = [name for name in SHADOWED if name in twin.__dict__]
    hooks = len(twin._forward_pre_hooks) + len(twin._forward_hooks)
    user_hooks = list(getattr(twin, "_comm_hooks", []))
    start = _flat(twin).clone()
    _train(twin, rank, COPY_STEPS, seed=2)
    twin_params = _flat(twin)
    gathered = [torch.zeros_like(twin_params) for _ in range(world_size)]
    dist.all_gather(gathered, twin_params)
    steps_at_copy = mon.steps
    _train(ddp, rank, STEPS_AFTER, seed=3)
    steps_later = mon.steps
    mon.close()
    return {
        "leftovers": leftovers,
        "hooks": hooks,
        "plain_hooks": plain_hooks,
        "comm_hooks": len(user_hooks),
        "twin_moved": not torch.equal(start, twin_params),
        "twin_same_on_all_ranks": all(torch.equal(gathered[0], g) for g in gathered),
        "steps_at_copy": steps_at_copy,
        "steps_later": steps_later,
        "log": str(mon.path),
    }


CASES = [(how, check_every) for check_every in (1, 1000) for how in ("deepcopy", "save_load")]


def copy_cases(rank: int, world_size: int, root: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Every case in turn, in one process group: each with a fresh DDP and monitor, its own run dir."""
    return {
        (how, check_every): copy_worker(rank, world_size, str(Path(root) / f"{how}-{check_every}"), how, check_every)
        for how, check_every in CASES
    }


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[tuple[str, int], dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("copy")
    return root, run_ranks(copy_cases, 2, args=(str(root),), timeout=180)


@pytest.mark.parametrize("how", ["deepcopy", "save_load"])
@pytest.mark.parametrize("check_every", [1, 1000])  # 1: a sample is in progress at copy time
def test_copy_of_an_instrumented_ddp_is_a_plain_ddp_and_the_original_stays_instrumented(
    copies: tuple[Path, list[dict[tuple[str, int], dict[str, Any]]]], how: str, check_every: int
) -> None:
    from ddpdoctor.runlog import load_run

    root, by_rank = copies
    results = [cases[(how, check_every)] for cases in by_rank]
    for r in results:
        assert r["leftovers"] == []
        assert r["hooks"] == r["plain_hooks"]  # none of ddpdoctor's forward hooks
        assert r["comm_hooks"] == 0  # the copy's fresh reducer has DDP's own all-reduce
        assert r["twin_moved"] and r["twin_same_on_all_ranks"]  # it trains, gradients averaged
        assert r["steps_later"] >= r["steps_at_copy"] + STEPS_AFTER - 1  # the last step closes at close()
    run = load_run(root / f"{how}-{check_every}")
    for log in run.ranks.values():
        # the original's log: every step of its own, none of the copy's, and a clean end
        assert [s.step for s in log.steps] == list(range(STEPS_BEFORE + STEPS_AFTER))
        assert log.end is not None and log.end.reason == "close"
