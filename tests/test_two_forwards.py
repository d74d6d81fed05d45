"""A model run forward twice before one backward: a GAN's discriminator, on real data, then on the
generator's output, then once more for the generator's loss (which all-reduces its gradients
again). DDP allows it; the sampled checks must not call the parameters of a forward that had no
backward of its own "unused" (an error, with a warning that the next iteration fails). Real
2-rank gloo, two DDP models in one process, instrumented and plain."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
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
