"""find_unused_parameters checked at every step (real gloo ranks, CPU): DDP's own map of the
parameters each step used is read at every synchronizing step, so a parameter unused only between
the sampled steps keeps ddpdoctor from calling the flag needless (turning it off would stop DDP at
the first such step), and a static unused set is said only when it held at every step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from tests.ddp_harness import run_ranks

pytestmark = pytest.mark.torch_compat

#: sampled steps with check_every=10: 0, 1, 3, 7, 10, 20, 30; the branch runs between them
CHECK_EVERY = 10
STEPS = 32
BRANCH_AT = (5, 13, 24)


class Branchy(torch.nn.Module):
    """A trunk, a head used at ``BRANCH_AT`` steps only (on rank 0), and a head never used."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(6, 6)
        self.sometimes = torch.nn.Linear(6, 6)
        self.never = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        y = self.trunk(x)
        return self.sometimes(y) if branch else y


def _train(rank: int, run_dir: str, branch_at: tuple[int, ...], never: bool) -> None:
    torch.manual_seed(0)
    model = Branchy()
    if not never:
        del model.never
    ddp = DDP(model, find_unused_parameters=True)
    monitor = ddpdoctor.instrument(ddp, run_dir=run_dir, check_every=CHECK_EVERY)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(STEPS):
        loss = ddp(torch.randn(3, 6), rank == 0 and step in branch_at).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()


def unused_runs(rank: int, world_size: int, tmp: str) -> None:
    _train(rank, tmp + "/between", BRANCH_AT, never=False)  # the head's use falls between samples
    _train(rank, tmp + "/static", (), never=True)  # the same two heads unused at every step
    _train(rank, tmp + "/all_used", tuple(range(STEPS)), never=False)  # every parameter, every step
    _train(rank, tmp + "/rare", BRANCH_AT, never=True)  # one head never used, one between samples


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("unused")
    run_ranks(unused_runs, 2, args=(str(tmp),), timeout=240)
    return tmp


def _findings(run_dir: Path) -> dict[str, Any]:
    return {f.code: f for f in ddpdoctor.analyze(ddpdoctor.load_run(run_dir)).findings}


def test_every_step_is_read_and_counted(runs: Path) -> None:
    log = ddpdoctor.load_run(runs / "between").ranks[0]
    samples = [u for u in log.unused if u.step >= 1]
    assert sum(u.steps_read for u in samples) >= STEPS - 6
    # the sampled steps saw "sometimes" unused each time, DDP's map saw it used at BRANCH_AT
    assert all("sometimes.weight" in u.names for u in samples)
    assert sum(u.steps_read - u.steps_with_unused for u in samples) == len(BRANCH_AT)
    assert sum(u.unused_set_changes for u in samples) == 2 * len(BRANCH_AT)


def test_a_head_used_between_the_samples_is_not_called_needless(runs: Path) -> None:
    found = _findings(runs / "between")
    assert "find-unused-unneeded" not in found, found.get("find-unused-unneeded")
    # the sampled checks saw it unused; DDP's map saw it used: not "never used"
    assert found["unused-parameters"].evidence["never_used"] == []


def test_a_static_set_is_said_where_every_step_had_it(runs: Path) -> None:
    f = _findings(runs / "static")["find-unused-unneeded"]
    assert f.evidence["static_set"] and sorted(f.evidence["names"]) == [
        "never.bias",
        "never.weight",
        "sometimes.bias",
        "sometimes.weight",
    ]
    assert "read at every step between the samples" in f.detail


def test_a_flag_never_needed_is_said_with_every_step_read(runs: Path) -> None:
    f = _findings(runs / "all_used")["find-unused-unneeded"]
    assert f.evidence["steps_read"] >= STEPS - 6 and "found none unused either" in f.detail
    # transformers' Trainer turns the flag on by default: the fix names every framework's switch
    assert "TrainingArguments(ddp_find_unused_parameters=False)" in f.fix
    assert "DDPStrategy(find_unused_parameters=False)" in f.fix and "DistributedDataParallelKwargs(find_unused" in f.fix


def test_never_used_means_on_no_step(runs: Path) -> None:
    f = _findings(runs / "rare")["unused-parameters"]
    # both heads unused at every sample; DDP's map saw "sometimes" used between them
    assert sorted(f.evidence["names"]) == ["never.bias", "never.weight", "sometimes.bias", "sometimes.weight"]
    assert sorted(f.evidence["never_used"]) == ["never.bias", "never.weight"]
    log = ddpdoctor.load_run(runs / "rare").ranks[1]
    assert {n for u in log.unused for n in u.used_between} == {"sometimes.weight", "sometimes.bias"}
