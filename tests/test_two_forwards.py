"""Two DDP models in one process, one of them run forward twice before one backward: a GAN's
discriminator, on real data, then on the generator's output, then once more for the generator's
loss (which all-reduces its gradients again). DDP allows it; the sampled checks must not call the
parameters of a forward that had no backward of its own "unused" (an error, with a warning that
the next iteration fails), and the report must say that the run holds two models and read each.
Real 2-rank gloo, instrumented and plain."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.cli.main import main
from tests.ddp_harness import run_ranks

STEPS = 12


def _gan(rank: int, run_dir: str | None) -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    gen_net = DDP(nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16)))
    disc = DDP(nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)))
    monitors = [ddpdoctor.instrument(m, run_dir) for m in (gen_net, disc)] if run_dir else []
    opt_g = torch.optim.Adam(gen_net.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(rank + 1)
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            real, z = torch.randn(8, 16, generator=g) + 1, torch.randn(8, 8, generator=g)
            fake = gen_net(z)
            opt_d.zero_grad()
            d_loss = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake.detach()), torch.zeros(8, 1))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            g_loss = bce(disc(fake), torch.ones(8, 1))
            g_loss.backward()
            opt_g.step()
            losses += [d_loss.item(), g_loss.item()]
        for m in monitors:
            m.close()
    return losses, [str(w.message) for w in caught if "ddpdoctor" in str(w.message)]


def _worker(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    plain, _ = _gan(rank, None)
    instrumented, said = _gan(rank, run_dir)
    return {"plain": plain, "instrumented": instrumented, "said": said}


@pytest.fixture(scope="module")
def gan(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    run_dir = tmp_path_factory.mktemp("gan") / "run"
    return run_ranks(_worker, args=(str(run_dir),)), run_dir


def test_a_forward_without_its_own_backward_is_not_unused(gan: Any) -> None:
    results, run_dir = gan
    for r in results:
        assert r["instrumented"] == r["plain"]  # bit-identical
        assert not [s for s in r["said"] if "unused" in s], r["said"]
    disc_logs = ddpdoctor.load_run(run_dir).other_models  # the second DDP model's rank files
    assert sorted((log.rank, log.ddp) for log in disc_logs) == [(0, 1), (1, 1)]
    for log in disc_logs:
        assert not [f for f in log.findings if f.code == "unused-parameters"]
        # the discriminator's steps: its real-data forward closed by the fake-data one (no
        # backward: 0, 3, 6, ...), then the two that all-reduce (1, 2, 4, 5, ...)
        assert [s.step for s in log.steps if not s.bucket_count()][:4] == [0, 3, 6, 9]
        sampled = [u.step for u in log.unused]
        # the schedule (0, 1, 3, 7, 15, 31): steps 0, 3 and 15 saw no gradient and were dropped,
        # and the forward after each sampled instead (1 was due anyway; 4 and 16 were not)
        assert sampled == [1, 4, 7, 16, 31]
        assert all(u.names == [] and None not in u.param_ready_us for u in log.unused)


def test_the_report_names_every_ddp_model_and_reports_each(
    gan: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, run_dir = gan
    reports = {}
    for model in (0, 1):
        out = tmp_path / f"report-{model}.json"
        assert main(["report", str(run_dir), "--ddp", str(model), "--format", "json", "-o", str(out)]) == 0
        reports[model] = json.loads(out.read_text())
    assert (reports[0]["run"]["ddp_model"], reports[0]["run"]["other_ddp_models"]) == (0, [1])
    assert (reports[1]["run"]["ddp_model"], reports[1]["run"]["other_ddp_models"]) == (1, [0])
    # the generator all-reduces once an iteration, the discriminator three times (one bare)
    assert (reports[0]["stats"]["steps"], reports[1]["stats"]["steps"]) == (STEPS, 3 * STEPS)
    assert "unused-parameters" not in {f["code"] for r in reports.values() for f in r["findings"]}
    # the real-data forwards closed by the fake-data ones: said, and out of the medians
    assert (reports[0]["stats"]["forwards_without_backward"], reports[1]["stats"]["forwards_without_backward"]) == (
        0,
        STEPS,
    )
    assert main(["report", str(run_dir)]) == 0
    assert f"the others: ddpdoctor report {run_dir} --ddp 1" in capsys.readouterr().out
    assert main(["report", str(run_dir), "--ddp", "2"]) == 2
    assert "no rank files of DDP model 2 here (models with files: 0, 1)" in capsys.readouterr().err


def test_every_view_reads_the_model_asked_for(gan: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--ddp K`` in trace and compare, and the live view's model, as in the report: the
    discriminator's three all-reduces an iteration, never the generator's one mixed in."""
    from tests.test_live_run import feed_all

    _, run_dir = gan
    for model, steps in ((0, STEPS), (1, 3 * STEPS)):
        out = tmp_path / f"trace-{model}.json"
        assert main(["trace", str(run_dir), "--ddp", str(model), "-o", str(out)]) == 0
        events = json.loads(out.read_text())["traceEvents"]
        assert len({e["args"]["step"] for e in events if e.get("name") == "forward"}) == steps, model
        compared = tmp_path / f"compare-{model}.json"
        assert (
            main(["compare", str(run_dir), str(run_dir), "--ddp", str(model), "--format", "json", "-o", str(compared)])
            == 0
        )
        assert json.loads(compared.read_text())["base"]["steps"] == steps, model
        _, snap = feed_all(run_dir, ddp=model)
        assert (snap.ddp, snap.ddp_models) == (model, (0, 1))
        assert snap.latest_step == steps - 1 and snap.finished, model
    assert main(["trace", str(run_dir), "--ddp", "2", "-o", str(tmp_path / "none.json")]) == 2
    assert "no rank files of DDP model 2 here" in capsys.readouterr().err


def test_collect_metrics_follow_the_model_asked_for(gan: Any) -> None:
    """``collect --metrics --ddp K``: the live state behind the metrics follows model K of the
    streams it receives (here: the run's real records, as a listener hands them over)."""
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from ddpdoctor.cli.collect_cmd import add_parser
    from ddpdoctor.cli.metrics_server import LiveFeed, SnapshotCollector
    from ddpdoctor.runlog import DirSource
    from ddpdoctor.stream.listener import Peer, StreamLine, StreamListener

    _, run_dir = gan
    source = DirSource(run_dir)
    polled = source.poll()
    source.close()
    listener = StreamListener("127.0.0.1", 0, None)
    try:
        for model, steps in ((0, STEPS), (1, 3 * STEPS)):
            feed = LiveFeed(listener, ddp=model)
            feed.feed([StreamLine(Peer("gan", None, rr.rank, rr.ddp), b"", rr.record) for rr in polled])
            snap = feed.snapshot()
            assert snap is not None and (snap.ddp, snap.ddp_models) == (model, (0, 1))
            assert snap.latest_step == steps - 1 and snap.finished, model
            registry = CollectorRegistry()
            registry.register(SnapshotCollector(feed.snapshot, run="gan"))
            text = generate_latest(registry).decode()
            assert f'ddpdoctor_ddp_model{{run="gan"}} {float(model)}' in text
            assert f'ddpdoctor_latest_step{{run="gan"}} {float(steps - 1)}' in text
    finally:
        listener.close()
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["collect", "--listen", "127.0.0.1:0", "--run-dir", "d", "--ddp", "1"])
    assert args.ddp == 1


async def test_the_watch_header_says_which_model_it_shows(gan: Any) -> None:
    from ddpdoctor.runlog.source import DirSource
    from ddpdoctor_tui import WatchApp
    from ddpdoctor_tui.run_header import RunHeader
    from tests.test_tui_watch import SIZE, wait_for, widget_text

    _, run_dir = gan
    app = WatchApp(DirSource(run_dir), interval=0.05, ddp=1)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.view_step == 3 * STEPS - 1)
        header = widget_text(app.query_one(RunHeader))
        assert "DDP model 1 (others: 0; watch --ddp K)" in header, header
