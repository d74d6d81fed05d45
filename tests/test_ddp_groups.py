"""DDP over subgroups of the world (data parallel inside model-parallel groups): four real gloo
ranks, two DDP groups of two, each training its own model. Ranks of different groups never
wait for each other at DDP's collectives and hold different replicas by design: the report, the
live view (and its TUI), ``compare``, the trace and the plots compare replicas, clocks and
arrivals within a group, and say the groups."""

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
from ddpdoctor.analysis.compare import compare
from ddpdoctor.analysis.live_run import LiveRun
from ddpdoctor.analysis.plot_data import plot_data
from ddpdoctor.analysis.trace import chrome_trace
from ddpdoctor.cli.render_compare import render_compare
from ddpdoctor.cli.render_text import render
from ddpdoctor.runlog import DirSource
from tests.ddp_harness import run_ranks

STEPS = 12
SLOW_S = 0.04  # rank 3, before every forward: a straggler in its own group


GROUPS_TEXT = "in 2 DDP groups (ranks 0,1 / 2,3)"


class _Counted(nn.Module):
    """A small MLP with a forward counter buffer: every rank of a group updates it the same way
    (DDP's broadcast of it is redundant within the group), each group from its own start."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.register_buffer("seen", torch.full((65536,), start))  # large enough to cost a share of the step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.net(x)


def _worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(rank // 2)  # each group its own model
    ddp = DDP(_Counted(float(rank // 2)), process_group=groups[rank // 2])
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
    # ... and the whole world's size: a live reader waits for the other group's ranks
    assert {log.header.dist_world_size for log in run.ranks.values() if log.header} == {4}
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


def test_the_live_view_blames_within_each_group(grouped: Any) -> None:
    _, tmp = grouped
    live = LiveRun()
    live.feed(DirSource(tmp).poll())
    snap = live.snapshot()
    assert snap.world_size == 4 and snap.ddp_groups == ((0, 1), (2, 3))
    # every rank's steps are viewed: the first group's ranks do not complete a step alone
    assert [r.rank for r in snap.ranks] == [0, 1, 2, 3] and snap.view_step == STEPS - 1
    assert [f.ranks for f in snap.findings if f.code == "straggler"] == [[3]], snap.findings
    lost = {r.rank: r.lost_for_others_ms for r in snap.ranks}
    assert lost[3] is not None and lost[3] >= SLOW_S * 1000 * (STEPS - 2) / 2, lost
    assert (lost[0] or 0.0) < lost[3] / 4 and (lost[1] or 0.0) < lost[3] / 4, lost
    # lateness is behind the earliest rank of the same group: rank 2 waits for rank 3, no one for group {2, 3}
    assert snap.heatmap is not None and set(snap.heatmap.late_ms) == {0, 1, 2, 3}
    late = {r.rank: r.late_ms for r in snap.ranks}
    assert late[3] is not None and late[3] >= SLOW_S * 1000 * 0.7, late
    assert all((late[r] or 0.0) < SLOW_S * 1000 / 4 for r in (0, 1, 2)), late


async def test_the_watch_header_says_the_groups(grouped: Any) -> None:
    from ddpdoctor_tui import WatchApp
    from ddpdoctor_tui.run_header import RunHeader
    from tests.test_tui_watch import SIZE, wait_for, widget_text

    _, tmp = grouped
    app = WatchApp(DirSource(tmp), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.view_step == STEPS - 1)
        header = widget_text(app.query_one(RunHeader))
        assert f"ranks 4/4 {GROUPS_TEXT}" in header, header


def test_compare_waits_and_says_within_groups(grouped: Any) -> None:
    _, tmp = grouped
    run = ddpdoctor.load_run(tmp)
    report = ddpdoctor.analyze(run)
    c = compare(run, run, report, report)
    assert c.base["ddp_groups"] == c.new["ddp_groups"] == [[0, 1], [2, 3]]
    assert f"base: 4 ranks {GROUPS_TEXT}" in render_compare(c)
    # each step's longest wait is rank 2's for rank 3 (~40 ms), not a wait across groups that
    # never wait for each other (their steps drift apart by 40 ms a step)
    wait = c.phase("bucket_wait")
    assert wait is not None and wait.base_ms is not None
    assert SLOW_S * 1000 * 0.7 <= wait.base_ms <= SLOW_S * 1000 * 1.5, wait


def test_the_trace_aligns_clocks_within_each_group(grouped: Any) -> None:
    _, tmp = grouped
    trace = chrome_trace(ddpdoctor.load_run(tmp))
    assert trace["otherData"]["ddp_groups"] == [[0, 1], [2, 3]]
    # one host, one clock: every offset is small. Aligned across groups, rank 2 would be shifted
    # by the groups' drift (the median of unrelated collectives' completion times)
    offsets = trace["otherData"]["clock_offsets_us"]
    assert set(offsets) == {"0", "1", "2", "3"} and all(abs(v) < 10_000 for v in offsets.values()), offsets
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names[1].endswith("DDP group 0,1") and names[3].endswith("DDP group 2,3"), names


def test_the_plots_show_lateness_within_each_group(grouped: Any) -> None:
    _, tmp = grouped
    data = plot_data(ddpdoctor.load_run(tmp))
    assert data.ddp_groups == [[0, 1], [2, 3]]
    step, _, ranks, late = data.heatmaps["worst"]
    assert ranks == [0, 1, 2, 3]
    row = {r: max(v) for r, v in zip(ranks, late, strict=True)}
    # behind the earliest rank of their own group, the others are about on time; the worst step is rank 3's
    # (the worst step's other ranks: at most half rank 3's lateness, as jitter on a loaded host
    # goes; compared across groups, ranks 0 and 1 would sit at the other group's clock skew)
    assert all(row[r] < min(row[3], SLOW_S * 1000) / 2 for r in (0, 1, 2)), (step, row)
    assert row[3] == max(row.values()) and row[3] >= SLOW_S * 1000 * 0.7, (step, row)


def test_the_buffer_broadcast_verdict_compares_within_each_group(grouped: Any) -> None:
    _, tmp = grouped
    report = ddpdoctor.analyze(ddpdoctor.load_run(tmp))
    cost = [f for f in report.findings if f.code == "buffer-broadcast-cost"]
    assert cost, report.findings
    # each group's counter is the same on its ranks (the groups' differ by design): redundant
    assert cost[0].evidence["broadcast_redundant"] is True, cost[0].evidence
    assert cost[0].evidence["would_drift"] == [], cost[0].evidence
