"""How ranks' replicas are compared (real gloo ranks): by exact fingerprints, so identical replicas
read identical on ranks whose float sums of a tensor differ in their last bits (another intra-op
thread count), and one element moved by one ulp on one rank still reads apart; and not where DDP
was told to leave a parameter or buffer to the script (``parameters_to_ignore``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.runtime.checks.fingerprints import fold_bits, tensor_bits
from tests.ddp_harness import run_ranks

#: elements of the large layer's weight: above ATen's grain for a parallel sum (32768), so a
#: rank's float sum of it is split by its intra-op thread count
WIDE = 1024
#: layers of WIDE x WIDE in ``threads_per_rank``
LARGE_LAYERS = 3


def test_bits_do_not_depend_on_the_thread_count() -> None:
    torch.manual_seed(0)
    t = torch.randn(WIDE * WIDE + 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (float(t.sum()), fold_bits(int(tensor_bits([t])[0])))
        torch.set_num_threads(2)
        two = (float(t.sum()), fold_bits(int(tensor_bits([t])[0])))
    finally:
        torch.set_num_threads(threads)
    assert one[1] == two[1]
    moved = t.clone()
    moved[12345] = torch.nextafter(moved[12345], torch.tensor(math.inf))  # one float32 ulp
    assert fold_bits(int(tensor_bits([moved])[0])) != one[1]


def ignored_per_rank(rank: int, tmp: str) -> dict[str, Any]:
    """A parameter and a buffer of each rank's own, kept out of DDP; rank 1 then edits a weight
    DDP keeps in step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with torch.no_grad():
        model[1].weight.add_(rank)  # a shard of its own on each rank
    model.register_buffer("seen", torch.full((3,), float(rank)))
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["1.weight", "seen"])
    ddp = DDP(model)
    monitor = ddpdoctor.instrument(ddp, run_dir=tmp + "/ignored")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(6):
        torch.manual_seed(100 * rank + step)
        loss = ddp(torch.randn(4, 8)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 4 and rank == 1:
            with torch.no_grad():
                model[0].bias[0] += 1.0
    monitor.close()
    return {"checked": [(f.code, f.evidence.get("names")) for f in ddpdoctor.check_replicas(ddp, warn=False)]}


def test_bits_without_numpy_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch runs without numpy: the CPU sums then take ATen's integer path, to the same values."""
    from ddpdoctor.runtime.checks import fingerprints

    torch.manual_seed(0)
    tensors = [
        torch.randn(300, 7),
        torch.randn(33).half(),
        torch.arange(9),
        torch.tensor([True, False]),
        torch.zeros(0),
    ]
    with_numpy = tensor_bits(tensors).tolist()
    monkeypatch.setattr(fingerprints, "_np", None)
    assert tensor_bits(tensors).tolist() == with_numpy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bits_on_the_gpu_equal_the_cpus() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(WIDE, WIDE + 1), torch.randn(77).bfloat16(), torch.arange(5), torch.randn(9).double()]
    on_gpu = tensor_bits([t.cuda() for t in tensors]).cpu().tolist()
    assert on_gpu == tensor_bits(tensors).tolist()


def threads_per_rank(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Rank r trains with r + 1 intra-op threads; then rank 1 moves one weight by one ulp. Then
    ``ignored_per_rank``."""
    torch.set_num_threads(rank + 1)
    torch.manual_seed(0)
    # three large layers: a float sum of one split in two (two threads) equals the sum in one
    # piece now and then (ATen's cascade sum is accurate; about 1 tensor in 8 here, and which one
    # depends on the CPU's vector width: this test's single layer did on one host), all three
    # hardly ever
    layers: list[torch.nn.Module] = []
    for _ in range(LARGE_LAYERS):
        layers += [torch.nn.Linear(WIDE, WIDE), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDE, 4))
    ddp = DDP(model)
    monitor = ddpdoctor.instrument(ddp, run_dir=tmp + "/run")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(4):
        torch.manual_seed(100 * rank + step)
        loss = ddp(torch.randn(8, WIDE)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    weight = model[0].weight
    out: dict[str, Any] = {
        "rank": rank,
        "sums": [float(p.detach().sum()) for p in model.parameters() if p.numel() >= WIDE * WIDE],
        "bytes": weight.detach().numpy().tobytes(),
        "identical": [f.code for f in ddpdoctor.check_replicas(ddp, warn=False)],
    }
    if rank == 1:
        with torch.no_grad():
            weight[3, 5] = torch.nextafter(weight[3, 5], torch.tensor(math.inf))
    moved = ddpdoctor.check_replicas(ddp, warn=False)
    out["moved"] = [(f.code, f.evidence.get("names")) for f in moved]
    out["moved_detail"] = [f.detail for f in moved]
    out["ignored"] = ignored_per_rank(rank, tmp)
    return out


@pytest.fixture(scope="module")
def threads_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("threads")
    return run_ranks(threads_per_rank, 2, args=(str(tmp),), timeout=240), tmp


def test_ranks_that_sum_apart_read_identical(threads_run: Any) -> None:
    results, tmp = threads_run
    zero, one = results
    assert zero["bytes"] == one["bytes"]  # DDP kept the replicas identical ...
    assert zero["sums"] != one["sums"]  # ... and their float sums differ (the case this is about)
    assert zero["identical"] == one["identical"] == []
    run = ddpdoctor.load_run(tmp / "run")
    prints = {r: run.ranks[r].fingerprints for r in (0, 1)}
    assert len(prints[0]) >= 4
    params = 2 * LARGE_LAYERS + 2
    assert all(
        len(fp.param_bits) == len(fp.param_norms) == params and fp.param_sums == [] for fp in prints[0] + prints[1]
    )
    report = ddpdoctor.analyze(run)
    assert [f.code for f in report.findings if f.code in ("replica-divergence", "buffer-divergence")] == []


def test_one_ulp_on_one_rank_reads_apart(threads_run: Any) -> None:
    results, _ = threads_run
    for r in results:
        assert r["moved"] == [("replica-divergence", ["0.weight"])]
        assert "the values differ in their last bits" in r["moved_detail"][0]


def test_what_ddp_ignores_is_not_compared(threads_run: Any) -> None:
    results, tmp = threads_run
    report = ddpdoctor.analyze(ddpdoctor.load_run(tmp / "ignored"))
    found = [(f.code, f.evidence.get("names")) for f in report.findings if f.code.endswith("-divergence")]
    # the weight DDP keeps in step and rank 1 edited is found; its own shard and buffer are not
    assert found == [("replica-divergence", ["0.bias"])]
    for r in results:
        assert r["ignored"]["checked"] == [("replica-divergence", ["0.bias"])]
