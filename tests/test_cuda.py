"""The CUDA path: event timing resolved without blocking, NCCL. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ddpdoctor
from tests.cuda_workers import nccl_train
from tests.ddp_harness import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_cuda_clock_resolves_events_without_blocking() -> None:
    from ddpdoctor.runtime.clocks import CudaClock

    clock = CudaClock()
    a = clock.now()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(10):
        x = x @ x / 2048
    b = clock.now()
    while not clock.ready([a, b]):  # query() only: the host never waits on the device
        pass
    assert clock.us(a, b) > 0


def test_nccl_world_size_one_is_timed_with_cuda_events(tmp_path: Path) -> None:
    run_ranks(nccl_train, 1, args=(str(tmp_path),), backend="nccl", timeout=300)
    log = ddpdoctor.load_run(tmp_path).ranks[0]
    assert log.header.clock == "cuda" and log.header.backend == "nccl"
    assert len(log.steps) == 6 and all(s.clock == "cuda" for s in log.steps)
    for s in log.steps:
        assert s.b_ready_us and all(r <= d for r, d in zip(s.b_ready_us, s.b_done_us, strict=False))
        assert s.fwd_us is not None and s.fwd_us > 0
