"""Rank-side code of the GPU tests (tests/test_cuda.py).

Each worker also runs on CPU (``device="cpu"``, gloo) so its logic is checked where no GPU is:
there the independent timer is the host clock and the stream checks are skipped.
"""

from __future__ import annotations

import contextlib
import faulthandler
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from tests.models import make_model


def _device(rank: int, device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class _SyncDebug:
    """``torch.cuda.set_sync_debug_mode(mode)`` inside the block (nothing on CPU): any device
    synchronization then raises ("error") or warns."""

    def __init__(self, device: torch.device, mode: str = "error", on: bool = True) -> None:
        self.on = on and device.type == "cuda"
        self.mode = mode

    def __enter__(self) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode(self.mode)

    def __exit__(self, *exc: object) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("default")


#: Steps before the sync check starts: DDP rebuilds its buckets after the first step, and that
#: (DDP's own work, not ddpdoctor's) may synchronize.
WARMUP = 2


def _train(
    ddp: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    check_syncs: bool = True,
) -> tuple[list[float], str | None]:
    """Plain training steps, under the sync debug mode "error" after ``WARMUP``; returns the
    losses (read at the end: reading them earlier would synchronize) and the first
    synchronization's message (None: there was none). After one the steps go on unchecked."""
    losses: list[torch.Tensor] = []
    sync: str | None = None
    for i, (x, y) in enumerate(data):
        checked = check_syncs and i >= WARMUP and sync is None
        try:
            with _SyncDebug(device, on=checked):
                loss = ((ddp(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        except RuntimeError as exc:
            if not checked or "synchroniz" not in str(exc):
                raise
            return [float(v) for v in losses], f"step {i}: {str(exc).splitlines()[0]}"
        losses.append(loss.detach())
    return [float(v) for v in losses], sync


def _watch_for_hangs(seconds: float = 90.0) -> None:
    """A rank stuck this long prints every thread's stack and exits (the test then says where)."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def _data(rank: int, steps: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(16, 32, generator=gen).to(device), torch.randn(16, 4, generator=gen).to(device))
        for _ in range(steps)
    ]


def train_pair(
    rank: int, world_size: int, tmp: str, device: str = "cuda", check_syncs: bool = True, log: str = "compact"
) -> dict[str, Any]:
    """The same six steps on a plain DDP, then on an instrumented one (sampled checks at 0, 1, 2,
    4: fingerprints, unused-parameter hooks, the post-forward timing; buffers broadcast every
    step), both under the sync debug mode after the warm-up (``check_syncs``). ``log``: the
    instrumented run's log mode ("full" also marks every bucket of every step with CUDA events).

    With NCCL the world size is 1 here (one GPU); with gloo two ranks share the GPU over CUDA
    tensors (NCCL refuses two ranks on one device). That run is not checked for synchronizations:
    gloo's CUDA collectives copy through the host and may synchronize, and a rank stopped by the
    check mid-step leaves the other waiting in a collective (the first GPU run of this test with
    the check hung). Where the plain run
    synchronizes, the instrumented one must do so no earlier.
    """
    _watch_for_hangs()
    dev = _device(rank, device)
    data = _data(rank, 6, dev)
    ids = [dev.index] if dev.type == "cuda" else None

    def build() -> tuple[DDP, torch.optim.Optimizer]:
        ddp = DDP(make_model().to(dev), device_ids=ids, bucket_cap_mb=0.01)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)

    plain, plain_opt = build()
    plain_losses, plain_sync = _train(plain, plain_opt, data, dev, check_syncs)
    ddp, opt = build()
    with ddpdoctor.instrument(ddp, run_dir=Path(tmp), check_every=2, log=log) as monitor:
        losses, sync = _train(ddp, opt, data, dev, check_syncs)
        probes_on = dict(monitor.probes.on)
        in_place_muls = _in_place_muls(ddp, opt, data[0]) - _in_place_muls(plain, plain_opt, data[0])
        buckets = len(monitor.recorder.layout_bytes())
    return {
        "in_place_muls": in_place_muls,
        "buckets": buckets,
        "rank": rank,
        "losses": losses,
        "sync": sync,
        "plain_losses": plain_losses,
        "plain_sync": plain_sync,
        "probes_on": probes_on,
    }


def _in_place_muls(ddp: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """In-place multiplies in one training step (the profiler's CPU ops): what a comm hook's scale
    pass adds, compared with the plain DDP's count."""
    x, y = batch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::mul_")


class HeavyNet(nn.Module):
    """Square layers big enough that the GPU, not the launches, sets each region's time."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class _Stamps:
    """The independent timer: CUDA events recorded on the current stream (host clock on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter_ns())
        return len(self.marks) - 1

    def us(self, a: int, b: int) -> float:
        if self.cuda:
            return float(self.marks[a].elapsed_time(self.marks[b]) * 1000.0)
        return (self.marks[b] - self.marks[a]) / 1000.0


def agreement_train(
    rank: int, world_size: int, tmp: str, device: str = "cuda", width: int = 4096, steps: int = 6
) -> dict[str, Any]:
    """Steps on a side stream (not the default one), with independent events around the forward
    and the backward; returns those regions per step, in µs from the step's first mark.

    On the side stream a mark recorded on any other stream (the default one, idle here) would
    resolve as soon as the host recorded it, long before the GPU reached that point of the step:
    the ordering checks of the test catch that.
    """
    _watch_for_hangs()
    dev = _device(rank, device)
    torch.manual_seed(0)
    model = HeavyNet(width, 4).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    x = torch.randn(width, width, device=dev)
    stream = torch.cuda.Stream() if dev.type == "cuda" else None
    regions: list[dict[str, float]] = []
    stamps = _Stamps(dev)
    with ddpdoctor.instrument(ddp, run_dir=Path(tmp), log="full"):
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            if stream is not None:
                stream.wait_stream(torch.cuda.default_stream(dev))  # x and the weights are ready
            marks = []
            for _ in range(steps):
                m0 = stamps.mark()  # right before the forward: the step's start
                out = ddp(x)
                m1 = stamps.mark()  # forward returned
                loss = out.float().square().mean()
                m2 = stamps.mark()  # backward starts
                loss.backward()
                m3 = stamps.mark()  # backward returned: DDP's stream waits for every bucket
                opt.step()
                opt.zero_grad()
                marks.append((m0, m1, m2, m3))
            m_last = stamps.mark()
        if stream is not None:
            stream.synchronize()  # the test's own wait, after the steps, outside the sync check
        for i, (m0, m1, m2, m3) in enumerate(marks):
            nxt = marks[i + 1][0] if i + 1 < len(marks) else m_last
            regions.append(
                {
                    "fwd_end": stamps.us(m0, m1),
                    "bwd_start": stamps.us(m0, m2),
                    "bwd_return": stamps.us(m0, m3),
                    "next_start": stamps.us(m0, nxt),
                }
            )
    return {"rank": rank, "regions": regions}
