"""The CUDA path: event marks on the gradient's stream, resolved without blocking; NCCL; gloo over
CUDA tensors; no added device synchronization; marks that agree with independent events.

Skipped without a GPU (CI has none); on a GPU machine, run ``pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ddpdoctor
from ddpdoctor.events.schedule import DEFAULT_EVERY, is_sampled
from tests.cuda_workers import agreement_train, train_pair
from tests.ddp_harness import run_ranks
from tests.divisor_workers import CUDA_CASES, divisor_runs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.torch_compat,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: How far a ddpdoctor mark may be from the independent event at the same point of the step:
#: both are CUDA events on the same stream, recorded a few host calls apart.
TOLERANCE_US = 50.0
TOLERANCE_FRACTION = 0.02


def test_cuda_clock_resolves_events_without_blocking() -> None:
    from ddpdoctor.runtime.step.clocks import CudaClock

    clock = CudaClock()
    a = clock.now()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(10):
        x = x @ x / 2048
    b = clock.now()
    while not clock.ready([a, b]):  # query() only: the host never waits on the device
        pass
    us = clock.us(a, b)
    assert us is not None and us > 0


def _check_pair(results: list[dict[str, Any]], tmp_path: Path, backend: str, world_size: int, mode: str) -> None:
    for r in results:
        print(r)  # (on the GPU machine: what each rank saw, for the record)
        # no synchronization added: where the plain DDP had none, the instrumented one has none;
        # where it had one, the instrumented one has its first no earlier
        if r["plain_sync"] is None:
            assert r["sync"] is None, r["sync"]
        else:
            assert r["sync"] is not None and len(r["losses"]) >= len(r["plain_losses"]), r
        assert r["losses"] == r["plain_losses"][: len(r["losses"])]  # bit-identical
        assert all(r["probes_on"].values()), r["probes_on"]
    run = ddpdoctor.load_run(tmp_path)
    assert len(run.ranks) == world_size
    trained = len(results[0]["losses"])
    for log in run.ranks.values():
        assert log.header is not None and log.header.clock == "cuda" and log.header.backend == backend
        steps = log.steps  # full records and, in the compact log, the window rows between them
        for s in steps:
            print(s)
        assert len(steps) >= trained  # (a step stopped by a synchronization counts)
        for s in steps[:trained]:
            assert s.clock == "cuda"
            # the full log marks every bucket of every step; the compact one only at the sampled
            # steps (0, 1, 3, ...), and between them the first and last bucket ready and DDP's
            # wait's end (timing events cost the GPU: step.recorder)
            marked = mode == "full" or is_sampled(s.step, DEFAULT_EVERY)
            assert s.per_bucket() == marked, s
            if marked:
                assert not s.summary and s.b_ready_us and len(s.b_done_us) == len(s.b_ready_us), s
                assert all(r <= d for r, d in zip(s.b_ready_us, s.b_done_us, strict=True))
            else:
                span = s.ready_span_us()
                assert span is not None and not s.b_done_us and s.bucket_bytes() > 0, s
                assert s.sync_end_us is not None and span[0] <= span[1] <= s.sync_end_us, s
            assert s.fwd_us is not None and s.fwd_us > 0
            assert s.bcast_us is not None and s.bcast_us > 0  # BatchNorm's buffers, every step
            assert s.bwd_end_us is not None and s.opt_start_us is not None
        assert log.fingerprints, "sampled fingerprints, copied behind an event"
        # the exact bits, summed on the GPU, copied with the norms
        assert all(fp.param_bits and len(fp.param_bits) == len(fp.param_norms) for fp in log.fingerprints)
        assert log.end is not None


def test_nccl_world_size_one_adds_no_synchronization(tmp_path: Path) -> None:
    """The default (compact) log: every bucket marked at the sampled steps only. At world size 1
    ddpdoctor's all-reduce does not multiply the bucket by 1.0 (no second pass over the
    gradients): no in-place multiply more than the plain DDP's step."""
    results = run_ranks(train_pair, 1, args=(str(tmp_path),), backend="nccl", timeout=120)
    _check_pair(results, tmp_path, "nccl", 1, "compact")
    assert results[0]["in_place_muls"] == 0, results[0]


def test_two_ranks_on_one_gpu_with_gloo_over_cuda_tensors(tmp_path: Path) -> None:
    """The full log: every bucket of every step marked with CUDA events. At world size 2 each
    bucket is scaled by 1/2 before its sum, as DDP does while it copies: one multiply a bucket."""
    args = (str(tmp_path), "cuda", False, "full")
    results = run_ranks(train_pair, 2, args=args, backend="gloo", timeout=120)
    _check_pair(results, tmp_path, "gloo", 2, "full")
    for r in results:
        assert r["buckets"] > 1 and r["in_place_muls"] == r["buckets"], r


def test_three_ranks_on_one_gpu_scale_each_bucket_as_ddp_does(tmp_path: Path) -> None:
    """gloo over CUDA tensors at world size 3, where a divide and a multiply by 1/3 differ:
    gradient_as_bucket_view with kept gradients, and Join(divide_by_initial_world_size=False).
    The Python route scales through the native extension's DdpScale (a GPU job builds it for
    this case): bit-identical to plain DDP; without the extension, each inexact case is said."""
    results = run_ranks(divisor_runs, 3, args=(str(tmp_path), "cuda"), timeout=600)
    for r in results:
        assert sorted(r["native"]) == sorted(CUDA_CASES)
        for name, (plain, instr, said) in r["native"].items():
            assert instr == plain, (name, r["rank"])
            assert not [s for s in said if "last bits" in s or "not honoured" in s], (name, said)
        assert any("world size of 3" in s for s in r["bare"]["kept"][1]), r["bare"]["kept"][1]


def test_marks_agree_with_independent_events_on_a_side_stream(tmp_path: Path) -> None:
    """Forward end and step duration within TOLERANCE of CUDA events around the same region; bucket
    marks between the backward's start and its return (a mark on another stream than the
    gradient's would resolve early, before the backward even started on the GPU)."""
    (result,) = run_ranks(agreement_train, 1, args=(str(tmp_path),), backend="nccl", timeout=120)
    regions = result["regions"]
    steps = [s for s in ddpdoctor.load_run(tmp_path).ranks[0].steps if not s.summary]
    for s, r in zip(steps, regions, strict=False):
        print(r, s)
    assert len(steps) == len(regions)

    def close(ours: float | None, theirs: float) -> bool:
        return ours is not None and abs(ours - theirs) <= TOLERANCE_US + TOLERANCE_FRACTION * theirs

    for s, r in zip(steps, regions, strict=True):
        assert close(s.fwd_end_us, r["fwd_end"]), (s.fwd_end_us, r)
        assert s.fwd_us is not None and r["fwd_end"] > 1000  # the GPU, not the launches, set it
        if s.end_us is not None:  # the last step's end is the close
            assert close(s.end_us, r["next_start"]), (s.end_us, r)
        slack = TOLERANCE_US
        span = s.ready_span_us()
        assert span is not None and span[0] >= r["bwd_start"] - slack, (s.b_ready_us, r)
        last_done = max(s.b_done_us) if s.per_bucket() else s.sync_end_us
        assert last_done is not None and last_done <= r["bwd_return"] + slack, (s.b_done_us, s.sync_end_us, r)
        assert s.bwd_end_us is not None and r["bwd_start"] - slack <= s.bwd_end_us <= r["bwd_return"] + slack
        # the backward's compute is most of the span between its start and its return
        assert span[1] - r["bwd_start"] > 0.5 * (r["bwd_return"] - r["bwd_start"]), (s.b_ready_us, r)


def test_real_jobs_under_ddpdoctor_run_train_as_they_do_without_it(tmp_path: Path) -> None:
    """PyTorch's DDP features as torchrun jobs on the GPU (NCCL), each under ``ddpdoctor run``
    beside the same job run plain (``bench/real_jobs.py``): bit-identical losses, a log timed with
    CUDA events that the report reads, no warning the plain job did not print."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.real_jobs import STEPS, run_scenario

    scenarios = ["fp16_hook", "static_graph", "join"]
    with ThreadPoolExecutor(len(scenarios)) as pool:
        results = list(pool.map(lambda name: run_scenario(name, "cuda", 1, tmp_path), scenarios))
    for r in results:
        print({k: v for k, v in r.items() if k not in ("report", "stderr", "plain_stderr")})
        assert (r["plain_rc"], r["rc"], r["report_rc"]) == (0, 0, 0), r
        assert r["same_losses"] and r["n_losses"] == STEPS + 1, r  # (and the final parameters' hash)
        assert (r["clock"], r["backend"], r["timing"]) == ("cuda", "nccl", "python"), r
        assert r["steps"] >= STEPS // 2 and r["per_bucket"] >= 3, r  # (steps 0, 1, 3 marked in full)
        assert not r["new_warnings"], r["new_warnings"]
