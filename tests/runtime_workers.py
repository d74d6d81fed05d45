"""Rank-side code of the runtime tests (module level, so spawned children can import it)."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.runtime import torch_compat
from tests.models import DelayNet, batches, make_model

BUCKET_CAP_MB = 0.01  # ~10 KB: SmallNet's ~60 KB of gradients fall into several buckets

COLLECTIVES = [
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "_broadcast_coalesced",
]


PG_METHODS = [
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "allgather",
    "_allgather_base",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "_reduce_scatter_base",
    "alltoall",
    "alltoall_base",
    "send",
    "recv",
    "recv_anysource",
]


class CollectiveCounter:
    """Counts calls into torch.distributed's collectives, into the ProcessGroup's methods (as
    ``pg.<name>``), and CUDA synchronizations, while active. DDP's own C++ all-reduces do not pass
    through Python and are not counted."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []

    def _patch(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return
        # restore the raw class attribute (pybind's method descriptor), not what getattr returned
        raw = owner.__dict__.get(attr, original) if isinstance(owner, type) else original
        self._saved.append((owner, attr, raw))

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.counts[label] = self.counts.get(label, 0) + 1
            return original(*args, **kwargs)

        setattr(owner, attr, counting)

    def __enter__(self) -> CollectiveCounter:
        for name in COLLECTIVES:
            self._patch(dist, name, name)
        for name in PG_METHODS:
            self._patch(dist.ProcessGroup, name, f"pg.{name}")
        self._patch(torch.cuda, "synchronize", "cuda.synchronize")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)


VARIANTS: dict[str, dict[str, Any]] = {
    "find_unused": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "bucket_view": {"gradient_as_bucket_view": True},
    "no_buffer_sync": {"broadcast_buffers": False},
}
if torch_compat.constructor_accepts("forward_sync_buffers"):
    # torch 2.13's new spelling of the same switch (2.12 and older have only broadcast_buffers)
    VARIANTS["forward_sync_off"] = {"forward_sync_buffers": False}


def train(ddp: torch.nn.Module, rank: int, steps: int = 6) -> list[float]:
    """Adam, BatchNorm, and a no_sync micro-step before every third step."""
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    data = iter(batches(rank, steps * 2))
    losses = []
    for s in range(steps):
        if s % 3 == 2:
            x, y = next(data)
            with ddp.no_sync():
                ((ddp(x) - y) ** 2).mean().backward()
        x, y = next(data)
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_uneven_under_join(ddp: DDP, rank: int, **join: Any) -> list[float]:
    """Uneven inputs under ``Join``: rank 0 has 5 batches, the others 3; the final parameters."""
    from torch.distributed.algorithms.join import Join

    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with Join([ddp], **join):
        for x, y in batches(rank, 5 if rank == 0 else 3):
            loss = ((ddp(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return torch.cat([p.detach().flatten() for p in ddp.module.parameters()]).tolist()


def train_with_closure(ddp: DDP, rank: int, steps: int = 5) -> list[float]:
    """``optimizer.step(closure)``, as Lightning runs every step: forward and backward inside it."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches(rank, steps):

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = ((ddp(x) - y) ** 2).mean()
            loss.backward()
            return loss

        losses.append(float(opt.step(closure)))
    return losses


def train_with_rebuild(ddp: DDP, rank: int, rebuild: Callable[[DDP], DDP], calls: list[int]) -> dict[str, Any]:
    """6 steps; after step 2 the head is frozen and DDP rebuilt by ``rebuild``."""
    ddp.register_comm_hook(calls, sum_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = iter(batches(rank, 6))
    losses = []
    for step in range(6):
        if step == 3:
            ddp.module.head.requires_grad_(False)
            ddp = rebuild(ddp)
        x, y = next(data)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    monitor = getattr(ddp, "ddpdoctor", None)
    if monitor is not None:
        monitor.close()
    return {
        "losses": losses,
        "type": type(ddp).__qualname__,
        "find_unused": ddp.find_unused_parameters,
        "cap": ddp.bucket_bytes_cap,
    }


def sum_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real (not string) annotations
    """A custom hook with a visible effect: sums gradients without averaging them."""
    state.append(bucket.index())
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def fresh_ddp() -> DDP:
    return DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)


def core_checks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    root = Path(tmp)
    out: dict[str, Any] = {"rank": rank}

    ddp = fresh_ddp()
    with CollectiveCounter() as c:
        out["plain"] = train(ddp, rank)
    out["plain_counts"] = c.counts

    ddp = fresh_ddp()
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with CollectiveCounter() as c:
        out["pyhook"] = train(ddp, rank)
    out["pyhook_counts"] = c.counts

    ddp = fresh_ddp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = ddpdoctor.instrument(ddp, run_dir=root / "instr")
        with CollectiveCounter() as c:
            out["instr"] = train(ddp, rank)
        monitor.close()
    out["instr_counts"] = c.counts
    out["instr_warnings"] = [
        f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, ddpdoctor.DDPDoctorWarning)
    ]
    out["instr_path"] = str(monitor.path)

    # torch's fp16 compression hook, registered BEFORE instrument
    ddp = fresh_ddp()
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    out["fp16_plain"] = train(ddp, rank)
    ddp = fresh_ddp()
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with ddpdoctor.instrument(ddp, run_dir=root / "fp16"):
        out["fp16_instr"] = train(ddp, rank)

    # a custom hook registered AFTER instrument
    calls: list[int] = []
    ddp = fresh_ddp()
    ddp.register_comm_hook(calls, sum_hook)
    out["sum_plain"] = train(ddp, rank)
    calls_instr: list[int] = []
    ddp = fresh_ddp()
    with ddpdoctor.instrument(ddp, run_dir=root / "custom"):
        ddp.register_comm_hook(calls_instr, sum_hook)
        out["sum_instr"] = train(ddp, rank)
    out["sum_hook_calls"] = (len(calls), len(calls_instr))
    # ... and one registered after some steps were already logged
    calls_late: list[int] = []
    ddp = fresh_ddp()
    with ddpdoctor.instrument(ddp, run_dir=root / "late_hook"):
        train(ddp, rank, steps=3)
        ddp.register_comm_hook(calls_late, sum_hook)
        train(ddp, rank, steps=3)
    try:
        ddp.register_comm_hook(None, sum_hook)
        out["second_register"] = "accepted"
    except RuntimeError as exc:
        out["second_register"] = str(exc)

    # an exception injected inside a probe
    ddp = fresh_ddp()
    monitor = ddpdoctor.instrument(ddp, run_dir=root / "probe")

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected failure")

    monitor.recorder.bucket_ready = boom  # type: ignore[method-assign]
    monitor.recorder.add_bucket_columns = boom  # type: ignore[method-assign]  # the native comm hook's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["probe"] = train(ddp, rank)
    monitor.close()
    out["probe_warnings"] = [
        (w.category.__name__, str(w.message)) for w in caught if issubclass(w.category, ddpdoctor.DDPDoctorWarning)
    ]

    # an unwritable run dir (its parent is a regular file)
    blocker = root / f"not-a-dir-{rank}"
    blocker.write_text("x")
    ddp = fresh_ddp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = ddpdoctor.instrument(ddp, run_dir=blocker / "run")
        out["unwritable"] = train(ddp, rank)
        monitor.close()
    out["unwritable_warnings"] = [
        (w.category.__name__, str(w.message)) for w in caught if issubclass(w.category, ddpdoctor.DDPDoctorWarning)
    ]
    out["unwritable_path"] = monitor.path

    # other DDP options: every one of them trains the same with ddpdoctor attached
    out["variants"] = {}
    for name, options in VARIANTS.items():
        plain = train(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB, **options), rank)
        ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB, **options)
        with ddpdoctor.instrument(ddp, run_dir=root / f"variant-{name}") as monitor:
            instr = train(ddp, rank)
        out["variants"][name] = (plain, instr, monitor.steps)

    # uneven inputs under Join: the joined rank shadows the others' all-reduces through the comm
    # hook, and Join syncs the final model: the same final parameters with ddpdoctor attached
    plain_join = train_uneven_under_join(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB), rank)
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    with ddpdoctor.instrument(ddp, run_dir=root / "join"):
        out["join"] = (plain_join, train_uneven_under_join(ddp, rank))
    # optimizer.step(closure): the optimizer's pre-hook runs before the forward
    plain_closure = train_with_closure(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB), rank)
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    with ddpdoctor.instrument(ddp, run_dir=root / "closure"):
        out["closure"] = (plain_closure, train_with_closure(ddp, rank))
    # divide_by_initial_world_size=False: once rank 1 joined, DDP divides rank 0's gradients by 1,
    # not 2; ddpdoctor's all-reduce reads that divisor from the reducer, and says nothing
    plain_rescaled = train_uneven_under_join(
        DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB), rank, divide_by_initial_world_size=False
    )
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ddpdoctor.instrument(ddp, run_dir=root / "join-rescaled"):
            out["join_rescaled"] = (
                plain_rescaled,
                train_uneven_under_join(ddp, rank, divide_by_initial_world_size=False),
            )
    out["join_rescaled_said"] = [str(w.message) for w in caught if issubclass(w.category, ddpdoctor.CommHookWarning)]

    # rewrap mid-training == rebuilding DDP by hand with the same options and hook
    def rebuilt_by_hand(ddp: DDP) -> DDP:
        new = DDP(ddp.module, bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=True)
        new.register_comm_hook(hook_calls, sum_hook)
        return new

    hook_calls: list[int] = []
    by_hand = train_with_rebuild(
        DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=True), rank, rebuilt_by_hand, hook_calls
    )
    rewrap_calls: list[int] = []
    model = ddpdoctor.DistributedDataParallel(
        make_model(), bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=True, ddpdoctor_run_dir=root / "rewrap"
    )
    out["rewrap"] = train_with_rebuild(model, rank, ddpdoctor.rewrap, rewrap_calls)
    out["rewrap_by_hand"] = by_hand
    out["rewrap_hook_calls"] = (len(hook_calls), len(rewrap_calls))
    out["check_replicas"] = [f.code for f in ddpdoctor.check_replicas(make_model())]

    # no run dir given: the ranks agree on one through the rendezvous store
    os.environ.pop("DDPDOCTOR_RUN_DIR", None)
    cwd = root / "cwd"
    cwd.mkdir(exist_ok=True)
    os.chdir(cwd)
    ddp = ddpdoctor.DistributedDataParallel(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    train(ddp, rank, steps=2)
    ddp.ddpdoctor.close()
    out["default_run_dir"] = str(ddp.ddpdoctor.run_dir.resolve())
    return out


DELAYS_S = (0.05, 0.12)  # rank 1's extra forward and backward seconds in delay_checks


def delay_checks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Rank 1's forward and backward are slower than rank 0's by DELAYS_S."""
    slow = rank == 1
    torch.manual_seed(0)
    forward_s, backward_s = DELAYS_S if slow else (0.0, 0.0)
    model = DelayNet(forward_s=forward_s, backward_s=backward_s)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    with ddpdoctor.instrument(ddp, run_dir=Path(tmp) / "delay"):
        train(ddp, rank, steps=5)
    return {"rank": rank}


class HostEvent:
    """Stands in for ``torch.cuda.Event`` where there is no GPU: ``record`` stamps the host clock."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.at: int | None = None

    def record(self) -> None:
        self.at = time.perf_counter_ns()

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end: HostEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) / 1e6  # ms, as CUDA events give it


def sampled_marks_run(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Rank 1 slow in backward, on the Python route, with the CUDA clock's code (its pool, its
    readiness, the recorder's pending steps) over events that stamp the host clock: the recorder
    marks every bucket only at the sampled steps, as on a GPU, and the CPU runs the same
    callbacks, DDP's finalization included."""
    from ddpdoctor.runtime.step import native_hook
    from ddpdoctor.runtime.step.clocks import CudaClock

    os.environ[native_hook.ENV] = "0"
    torch.manual_seed(0)
    ddp = DDP(DelayNet(backward_s=0.12 if rank == 1 else 0.0), bucket_cap_mb=BUCKET_CAP_MB)
    with ddpdoctor.instrument(ddp, run_dir=Path(tmp) / "sampled") as monitor:
        clock = CudaClock.__new__(CudaClock)
        clock._event, clock._pool, clock._record = HostEvent, [], HostEvent.record
        monitor.recorder.clock = clock  # (before the first step: no mark taken yet)
        monitor.recorder.bucket_marks_every_step = False
        monitor.recorder.build_step = None
        losses = train(ddp, rank, steps=10)
        # without the backward-end callback there is no sync-end mark: every bucket is marked again
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            monitor.probes.failed("backward_end", RuntimeError("switched off by the test"))
        losses += train(ddp, rank, steps=2)
    return {"rank": rank, "losses": losses, "timing": monitor.attachment.header.timing}


def straggler_runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Three runs in one process group: rank 1 slow in backward, slow in data loading, and none."""
    import time as _time

    for name, backward_s, data_s in (("slow-backward", 0.15, 0.0), ("slow-data", 0.0, 0.1), ("healthy", 0.0, 0.0)):
        slow = rank == 1
        torch.manual_seed(0)
        ddp = DDP(DelayNet(backward_s=backward_s if slow else 0.0), bucket_cap_mb=BUCKET_CAP_MB)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        data = batches(rank, 10)
        with ddpdoctor.instrument(ddp, run_dir=Path(tmp) / name):
            for x, y in data:
                if slow and data_s:
                    _time.sleep(data_s)  # a slow input pipeline on this rank
                loss = ((ddp(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return {"rank": rank}


def _param_sums(model: torch.nn.Module) -> list[float]:
    return [float(p.detach().double().sum()) for p in model.parameters()]


def _ddp_surface(ddp: DDP) -> dict[str, Any]:
    """What must be exactly as before after a failed attach."""
    return {
        "dict": sorted(ddp.__dict__),
        "pre": list(ddp._forward_pre_hooks),
        "post": list(ddp._forward_hooks),
        "module_pre": list(ddp.module._forward_pre_hooks),
        "reducer": id(ddp.reducer),
        "comm_hooks": len(getattr(ddp, "_comm_hooks", [])),
    }


def attach_fault_checks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Fail ``instrument`` at every attach step, with and without a comm hook registered first;
    after each, DDP must be as it was and still average gradients across the ranks."""
    import threading

    from ddpdoctor.runtime import attach

    root = Path(tmp)
    data = batches(rank, 3)  # different data per rank: only averaged gradients keep replicas equal
    out: dict[str, Any] = {}
    # a first monitor, closed: the process-wide parts that outlive monitors exist from here on
    with ddpdoctor.instrument(fresh_ddp(), run_dir=root / "warm"):
        pass

    def run(hook_first: bool, fail: str | None) -> dict[str, Any]:
        ddp = fresh_ddp()
        if hook_first:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        before = _ddp_surface(ddp)
        threads = {t.ident for t in threading.enumerate()}
        attach.fail_at = fail
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                monitor = ddpdoctor.instrument(ddp, run_dir=root / f"{hook_first}-{fail}")
        finally:
            attach.fail_at = None
        result: dict[str, Any] = {
            "disabled": not hasattr(monitor, "recorder"),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, ddpdoctor.DDPDoctorWarning)],
            "surface_same": _ddp_surface(ddp) == before,
            "registered": attach.monitor_of(ddp) is not None,
            "new_threads": sorted(t.name for t in threading.enumerate() if t.ident not in threads),
        }
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        sums = []
        for x, y in data:
            loss = ((ddp(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sums.append(_param_sums(ddp.module))
        monitor.close()
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, sums)
        result["replicas_equal"] = all(g == gathered[0] for g in gathered)
        result["sums"] = sums
        return result

    for hook_first in (False, True):
        out[f"plain-{hook_first}"] = run(hook_first, None)  # attach succeeds: the reference
        for step in attach.STEPS:
            out[f"{step}-{hook_first}"] = run(hook_first, step)
    return out


def rewrap_typo_check(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """``rewrap(model, find_unused_paramters=True)`` raises; the old model trains on, averaged."""
    ddp = ddpdoctor.DistributedDataParallel(make_model(), bucket_cap_mb=BUCKET_CAP_MB, ddpdoctor_run_dir=Path(tmp))
    try:
        ddpdoctor.rewrap(ddp, find_unused_paramters=True)
        error = ""
    except TypeError as exc:
        error = str(exc)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in batches(rank, 3):
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    still = not ddp.ddpdoctor.closed and ddp.ddpdoctor.steps == 2
    ddp.ddpdoctor.close()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, _param_sums(ddp.module))
    return {"error": error, "replicas_equal": all(g == gathered[0] for g in gathered), "still_monitored": still}
