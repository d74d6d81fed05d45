"""Buffer broadcasts the sampled checks do not see. Gradient accumulation with BatchNorm: DDP
broadcasts the buffers in the first micro-step's forward, not in the synchronizing one, so the
sampled steps' fingerprints (taken in the synchronizing forward) never follow a broadcast. The
buffers then differ across ranks at every check, as they do between broadcasts in any run, and
that is not divergence: the next cycle's broadcast puts them back in step. An evaluation forward
after the last step: DDP broadcasts rank 0's buffers there, so the final fingerprint shows them
identical, which says nothing of whether the ranks update them alike. Real 2-rank gloo DDP,
instrumented and plain."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.analysis.buffers import broadcast_redundancy
from ddpdoctor.analysis.replicas import compare_fingerprints
from tests.ddp_harness import run_ranks

pytestmark = pytest.mark.torch_compat

STEPS = 8
MICRO = 2


def _train(
    rank: int, run_dir: str | None, micro_steps: int = MICRO, evaluate: bool = False, eval_grad: bool = False
) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    ddp = DDP(model)
    monitor = ddpdoctor.instrument(ddp, run_dir) if run_dir is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank + 1)
    losses = []
    for _ in range(STEPS):
        for micro in range(micro_steps):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with ddp.no_sync() if micro < micro_steps - 1 else nullcontext():
                loss = ((ddp(x) - y) ** 2).mean()
                loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if evaluate:  # DDP broadcasts rank 0's buffers at the first forward after training
        ddp.eval()
        with torch.no_grad() if not eval_grad else nullcontext():  # (evaluation with grad on: a common slip)
            for _ in range(3):
                ddp(torch.randn(8, 16, generator=g))
    if monitor is not None:
        monitor.close()
    return losses


def _worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    return {
        "plain": _train(rank, None),
        "instrumented": _train(rank, tmp),
        "evaluated": _train(rank, str(Path(tmp) / "evaluated"), micro_steps=1, evaluate=True),
        "evaluated_with_grad": _train(
            rank, str(Path(tmp) / "evaluated_with_grad"), micro_steps=1, evaluate=True, eval_grad=True
        ),
    }


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("accumulate-bn")
    return run_ranks(_worker, args=(str(tmp / "accumulated"),)), tmp / "accumulated"


def test_buffers_broadcast_in_the_first_micro_step_are_not_called_divergent(accumulated: Any) -> None:
    results, tmp = accumulated
    for r in results:
        assert r["instrumented"] == r["plain"]
    run = ddpdoctor.load_run(tmp)
    # what the finding must not rest on: no fingerprint followed a broadcast, the buffers differ
    # across ranks at the sampled steps, and the steps show DDP broadcasting them
    prints = {rank: log.fingerprints for rank, log in run.ranks.items()}
    assert not any(fp.after_broadcast for fps in prints.values() for fp in fps)
    assert len({fp.buffer_sums[0] for fps in prints.values() for fp in fps if fp.step == 1 and not fp.final}) == 2
    assert all(s.bcast_bytes > 0 for log in run.ranks.values() for s in log.steps)
    header = run.ranks[0].header
    assert header is not None and header.ddp_options["broadcast_buffers"] is True
    found = ddpdoctor.analyze(run).findings
    assert not [f for f in found if f.code in ("buffer-divergence", "replica-divergence")], found
    # the same fingerprints, with no step seen broadcasting: then the difference is divergence
    assert [f.code for f in compare_fingerprints(header, prints)] == ["buffer-divergence"]
    assert [f.code for f in compare_fingerprints(header, prints, broadcast_seen=True)] == []


def test_divergence_of_buffers_ddp_was_asked_to_broadcast_says_no_broadcast_was_seen(accumulated: Any) -> None:
    _, tmp = accumulated
    run = ddpdoctor.load_run(tmp)
    header = run.ranks[0].header
    assert header is not None
    (finding,) = compare_fingerprints(header, {rank: log.fingerprints for rank, log in run.ranks.items()})
    # broadcast_buffers=True: the fix must not claim it is False
    assert "broadcast_buffers=False" not in finding.fix
    assert "no buffer broadcast was seen" in finding.fix


@pytest.mark.parametrize("evaluation", ["evaluated", "evaluated_with_grad"])
def test_buffers_broadcast_by_an_evaluation_after_the_last_step_are_no_evidence_of_redundancy(
    accumulated: Any, evaluation: str
) -> None:
    """Without accumulation the sampled fingerprints follow a broadcast; the final one, at close,
    shows each rank's own buffers, unless an evaluation forward broadcast rank 0's copy after the
    last step: then the identical buffers must not make the broadcast look redundant. The same
    with the evaluation run with grad on (its forwards open steps of their own)."""
    _, tmp = accumulated
    run = ddpdoctor.load_run(tmp / evaluation)
    prints = {rank: log.fingerprints for rank, log in run.ranks.items()}
    finals = [fp for fps in prints.values() for fp in fps if fp.final]
    assert len(finals) == 2 and all(fp.after_broadcast for fp in finals)
    assert all(fp.after_broadcast for fps in prints.values() for fp in fps if not fp.final)
    # rank 0's copy on both ranks: identical, and no evidence either way
    assert len({fp.buffer_sums[0] for fp in finals}) == 1
    header = run.ranks[0].header
    assert header is not None
    assert broadcast_redundancy(header, prints) is None
    report = ddpdoctor.analyze(run)
    assert not [f for f in report.findings if "redundant" in f.detail]
    # the evaluation's forwards with grad on are steps without a backward: counted apart
    assert report.stats["forwards_without_backward"] == (3 if evaluation == "evaluated_with_grad" else 0)
    assert report.stats["steps"] == STEPS + report.stats["forwards_without_backward"]
