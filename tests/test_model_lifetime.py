"""A monitor never keeps the DDP model alive.

- closed (and kept by the script): after ``mon.close(); del model; gc.collect()`` the model is
  gone, while the watchdog and process-sampler threads run on for another monitored model (they
  used to hold the last monitor in a loop variable while sleeping, and the attachment a closure
  over DDP's bound ``_sync_buffers``);
- not closed: a model the script drops is freed by reference counting alone (the cyclic
  collector off), as a plain DDP is: the monitor reaches the model through weak references.
"""

from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from tests.ddp_harness import run_ranks

# (timing: each run waits for the monitor's threads against a wall-clock deadline)
pytestmark = [pytest.mark.torch_compat, pytest.mark.timing]


def _model(bucket_view: bool = False) -> Any:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    return DDP(net, gradient_as_bucket_view=bucket_view)


def _train(model: Any, steps: int = 3) -> None:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 8)).sum().backward()
        opt.step()


def _until(condition: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _threads_went_round(mon: Any) -> None:
    """Wait until the watchdog thread checked ``mon`` and the sampler thread sampled it."""
    from ddpdoctor.runtime.process.services import services

    dog = services()._watchdog
    assert dog is not None
    _until(lambda: dog._watches[id(mon.hooks)].last is not None, "a watchdog round")

    def sampled() -> bool:
        mon.flush()
        return '"proc"' in Path(mon.path).read_text()

    _until(sampled, "a process sample")


def lifetime_worker(rank: int, world_size: int, run_dir: str, case: str, bucket_view: bool = False) -> dict[str, Any]:
    import ddpdoctor
    from ddpdoctor.runtime.process.services import services

    opts = {"hang_timeout": 0.5, "proc_interval": 0.05, "check_every": 2}
    keeper = _model()  # monitored to the end: the process's threads keep running
    keeper_mon = ddpdoctor.instrument(keeper, str(Path(run_dir) / "keeper"), **opts)

    # the baseline: what a plain DDP does when the script drops it
    plain = _model()
    _train(plain)
    gc.collect()
    gc.disable()
    try:
        plain_ref = weakref.ref(plain)
        del plain
        plain_freed_by_refcount = plain_ref() is None
    finally:
        gc.enable()

    model = _model(bucket_view)
    mon = ddpdoctor.instrument(model, str(Path(run_dir) / "model"), **opts)
    native = mon.attachment.native
    watched = native is not None and native.exact[1]  # the scale's pre-hooks on the accumulators
    _train(model)
    _train(keeper)
    _threads_went_round(mon)
    ref = weakref.ref(model)
    if case == "closed":
        mon.close()
        del model
        gc.collect()
        freed = ref() is None
    else:
        gc.collect()
        gc.disable()
        try:
            if case == "dropped_with_monitor":
                mon = None  # as under `ddpdoctor run`: only the model held the monitor
            del model
            freed = ref() is None  # reference counting alone
        finally:
            gc.enable()
    threads = len(services().threads)
    kept_mon_alive = mon is not None  # the script still holds its monitor
    ended = mon is None or mon.closed
    _train(keeper)  # the other model is still monitored
    keeper_steps = keeper_mon.steps
    keeper_mon.close()
    return {
        "freed": freed,
        "plain_freed_by_refcount": plain_freed_by_refcount,
        "threads": threads,
        "kept_mon_alive": kept_mon_alive,
        "keeper_steps": keeper_steps,
        "ended": ended,
        "watched": watched,
    }


def test_a_closed_monitor_kept_by_the_script_does_not_keep_the_model_alive(tmp_path: Path) -> None:
    (r,) = run_ranks(lifetime_worker, 1, args=(str(tmp_path), "closed"), timeout=120)
    assert r["threads"] == 2  # watchdog and sampler still running for the other model
    assert r["kept_mon_alive"] and r["freed"]
    assert r["keeper_steps"] >= 5


def test_a_model_dropped_without_close_is_freed_by_reference_counting_as_plain_ddp(tmp_path: Path) -> None:
    (r,) = run_ranks(lifetime_worker, 1, args=(str(tmp_path), "dropped"), timeout=120)
    assert r["threads"] == 2
    assert r["plain_freed_by_refcount"], "plain DDP itself is not freed by reference counting here"
    assert r["freed"]
    assert r["keeper_steps"] >= 5


def test_a_model_dropped_without_close_ends_its_log(tmp_path: Path) -> None:
    """Dropped with nobody holding its monitor: the log is complete (every step, an End record)
    when the model goes, not cut short or left open until exit; the other model's threads run on."""
    import ddpdoctor

    (r,) = run_ranks(lifetime_worker, 1, args=(str(tmp_path), "dropped_with_monitor"), timeout=120)
    assert r["freed"] and r["ended"] and r["threads"] == 2
    log = ddpdoctor.load_run(tmp_path / "model").ranks[0]
    assert [s.step for s in log.steps] == [0, 1, 2]
    assert log.end is not None and log.end.reason == "close"


def test_a_monitor_whose_scale_watches_the_gradients_keeps_no_model_alive(tmp_path: Path) -> None:
    """Under gradient_as_bucket_view at 3 ranks the native hook's scale puts a pre-hook on every
    gradient accumulator: it holds neither them nor DDP's reducer, so the model goes as before."""
    for case in ("closed", "dropped"):
        for r in run_ranks(lifetime_worker, 3, args=(str(tmp_path / case), case, True), timeout=120):
            assert r["watched"]
            assert r["freed"], case
