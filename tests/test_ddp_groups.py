"""DDP over subgroups of the world (data parallel inside model-parallel groups): four real gloo
ranks, two DDP groups of two, each training its own model. Ranks of different groups never
wait for each other at DDP's collectives and hold different replicas by design: the report
compares replicas and arrivals within a group."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.cli.render_text import render
from tests.ddp_harness import run_ranks

STEPS = 12
SLOW_S = 0.04  # rank 3, before every forward: a straggler in its own group


def _worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(rank // 2)  # each group its own model
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), process_group=groups[rank // 2])
    monitor = ddpdoctor.instrument(ddp, tmp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        if rank == 3:
            time.sleep(SLOW_S)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    found = ddpdoctor.check_replicas(ddp, warn=False)
    monitor.close()
    return {"check_replicas": [f.code for f in found]}


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("ddp-groups")
    return run_ranks(_worker, world_size=4, args=(str(tmp),), timeout=240), tmp


def test_each_rank_logs_its_ddp_group(grouped: Any) -> None:
    results, tmp = grouped
    assert [r["check_replicas"] for r in results] == [[], [], [], []]
    run = ddpdoctor.load_run(tmp)
    assert {r: log.header.group_ranks for r, log in run.ranks.items() if log.header} == {
        0: [0, 1],
        1: [0, 1],
        2: [2, 3],
        3: [2, 3],
    }
    assert {log.header.world_size for log in run.ranks.values() if log.header} == {2}
    assert run.world_size == 4 and run.missing_ranks() == []


def test_replicas_and_stragglers_are_compared_within_each_group(grouped: Any) -> None:
    _, tmp = grouped
    report = ddpdoctor.analyze(ddpdoctor.load_run(tmp))
    assert report.run["ddp_groups"] == [[0, 1], [2, 3]]
    # the two groups' models differ by design: not divergence
    assert not [f for f in report.findings if f.code in ("replica-divergence", "buffer-divergence")], report.findings
    # rank 3 holds rank 2 at every step; ranks 0 and 1 never wait for it
    stragglers = [f for f in report.findings if f.code == "straggler"]
    assert [f.ranks for f in stragglers] == [[3]], report.findings
    lost = {e["rank"]: e["time_lost_for_others_ms"] for e in report.ranks}
    assert lost[3] >= SLOW_S * 1000 * (STEPS - 2) / 2, lost
    assert lost[0] < lost[3] / 4 and lost[1] < lost[3] / 4, lost
    text = render(report)
    assert "world size 4 in 2 DDP groups (ranks 0,1 / 2,3)" in text
