"""Local SGD (torch's ``post_localSGD_hook`` and a ``PeriodicModelAverager``), with ddpdoctor
attached, on real gloo ranks: training is bit for bit that of plain DDP, and the replicas that the
hook lets train apart between model averagings are said as information, not as an error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ddpdoctor
from tests.ddp_harness import run_ranks

pytestmark = pytest.mark.torch_compat

STEPS, START, PERIOD, CHECK_EVERY = 30, 6, 4, 8


def _train(ddp: Any, subgroup: Any, rank: int, check: str) -> tuple[list[float], list[Any]]:
    """STEPS steps of local SGD from START on, averaged every PERIOD steps; ``check_replicas``
    right after the averagings ("averaged") or at the steps between them ("between")."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    state = local.PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=START)
    ddp.register_comm_hook(state, local.post_localSGD_hook)
    averager = PeriodicModelAverager(period=PERIOD, warmup_steps=START)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)  # each rank its own data: the replicas move apart
    found = []
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        averaged = step >= START and (step - START) % PERIOD == 0
        averager.average_parameters(ddp.parameters())
        if step > START and averaged == (check == "averaged"):
            found += [f.code for f in ddpdoctor.check_replicas(ddp, warn=False)]
    return torch.cat([p.detach().flatten() for p in ddp.parameters()]).tolist(), found


def local_sgd_worker(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    subgroup, _ = dist.new_subgroups(group_size=1)

    def model() -> DDP:
        torch.manual_seed(0)
        return DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))

    plain, between = _train(model(), subgroup, rank, "between")
    ddp = model()
    with ddpdoctor.instrument(ddp, run_dir, check_every=CHECK_EVERY):  # the hook comes after it
        instrumented, averaged = _train(ddp, subgroup, rank, "averaged")
    return {"same": plain == instrumented, "between": between, "averaged": averaged}


@pytest.fixture(scope="module")
def local_sgd_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    run_dir = tmp_path_factory.mktemp("local_sgd")
    return run_ranks(local_sgd_worker, 2, args=(str(run_dir),), timeout=180), run_dir


def test_local_sgd_trains_as_without_ddpdoctor(local_sgd_run: Any) -> None:
    results, _ = local_sgd_run
    assert all(r["same"] for r in results)


def test_replicas_apart_between_averagings_are_information(local_sgd_run: Any) -> None:
    results, run_dir = local_sgd_run
    # the replicas do differ between averagings, and agree right after them
    assert all("replica-divergence" in r["between"] for r in results), results
    assert all(r["averaged"] == [] for r in results), results
    findings = ddpdoctor.analyze(ddpdoctor.load_run(run_dir)).findings
    apart = [f for f in findings if f.code == "replica-divergence"]
    assert len(apart) == 1, findings
    assert apart[0].severity == "info" and apart[0].evidence["local_sgd"] is True, apart[0]
    assert "post_localSGD_hook" in apart[0].detail
    assert not [f for f in findings if f.severity == "error"], findings
