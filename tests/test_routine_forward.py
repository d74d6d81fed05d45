"""The monitor's routine forward (in ``StepHooks.on_forward_pre``) against its full path.

The routine path is the full path's rule unrolled for the common forward (a synchronizing step
after a synchronizing step, nothing to capture). Two real gloo ranks train the same model over
the same steps twice, once with the routine path and once without, through every kind of step
the full path knows: plain steps, sampled steps, ``no_sync`` micro-steps, evaluation forwards
with and without grad, an optimizer step that runs a closure, a backward without an optimizer
step, a parameter frozen and unfrozen, a second model's optimizer stepping between this model's
forward and backward. Every record must be the same in both runs, but for the
clock's values: which fields hold a mark, the per-bucket lists' lengths, bytes, step indices,
micro-steps, fingerprints (the same training, so the same values) and sampled-check records.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.events import End, FindingRecord, Header, ProcSample, Record, Step
from ddpdoctor.runtime.step import hooks as hooks_module
from ddpdoctor.sinks.memory import MemorySink
from tests.ddp_harness import run_ranks
from tests.models import make_model
from tests.runtime_workers import BUCKET_CAP_MB

#: fields of a Step that hold times (compared by whether they are set, not by value)
_TIMES = {
    "t0_mono_ns",
    "t0_wall_ns",
    "fwd_start_us",
    "fwd_us",
    "bcast_start_us",
    "bcast_us",
    "fwd_end_us",
    "bwd_end_us",
    "sync_end_us",
    "opt_start_us",
    "opt_end_us",
    "end_us",
}
_TIME_LISTS = {"b_ready_us", "b_launch_us", "b_done_us"}


def _shape(record: Record) -> Any:
    """What must not depend on the path taken: the record with its clock values left out."""
    if isinstance(record, Step):
        out: dict[str, Any] = {}
        for field in record.__struct_fields__:
            value = getattr(record, field)
            if field in _TIMES:
                out[field] = value is not None
            elif field in _TIME_LISTS:
                out[field] = [v is not None for v in value]
            else:
                out[field] = value
        return ("step", out)
    fields = {f: getattr(record, f) for f in record.__struct_fields__}
    if "post_forward_us" in fields:  # (an Unused record's times)
        fields["post_forward_us"] = fields["post_forward_us"] is not None
        fields["param_ready_us"] = [v is not None for v in fields["param_ready_us"]]
    return (type(record).__name__, fields)


def _train(rank: int, world_size: int, routine: bool) -> tuple[list[Any], int, int, int]:
    hooks_module.StepHooks.routine_forward = routine
    taken = [0, 0]  # forwards that took the full path, forwards in all
    full = hooks_module.StepHooks._forward_pre

    def counted(self: Any, module: Any, native: Any) -> None:
        taken[0] += 1
        full(self, module, native)

    hooks_module.StepHooks._forward_pre = counted  # type: ignore[method-assign]
    torch.manual_seed(1)
    data = [(torch.randn(8, 32), torch.randn(8, 4)) for _ in range(6)]
    sink = MemorySink()
    # find_unused_parameters: a parameter frozen after wrapping is then left out, not waited for
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=True)
    monitor = ddpdoctor.instrument(ddp, sink=sink, check_every=8)
    packed = [0]  # records built from packed marks (the routine forward's drain)
    build = monitor.recorder.build_step
    assert build is not None

    def counting(step: Any, *args: Any) -> Any:
        packed[0] += step.packed is not None
        return build(step, *args)

    monitor.recorder.build_step = counting
    ddp.register_forward_pre_hook(lambda *_: taken.__setitem__(1, taken[1] + 1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    step = 0

    def loss(i: int) -> torch.Tensor:
        x, y = data[i % len(data)]
        return ((ddp(x) - y) ** 2).mean()

    def train_step() -> None:
        nonlocal step
        opt.zero_grad()
        loss(step).backward()
        opt.step()
        step += 1

    for _ in range(12):
        train_step()
    for _ in range(2):  # gradient accumulation: two micro-steps, then the synchronizing one
        opt.zero_grad()
        with ddp.no_sync():
            loss(1).backward()
            loss(2).backward()
        loss(3).backward()
        opt.step()
    with torch.no_grad():  # an evaluation forward between steps
        ddp.eval()
        ddp(data[0][0])
        ddp.train()
    train_step()
    ddp.eval()  # a step trained in eval mode (BatchNorm frozen)
    train_step()
    ddp.train()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = loss(4)
        value.backward()
        return value

    for _ in range(3):
        opt.step(closure)
    loss(5).backward()  # a backward without an optimizer step
    for _ in range(4):
        train_step()
    ddp.module.head.bias.requires_grad_(False)
    for _ in range(5):
        train_step()
    ddp.module.head.bias.requires_grad_(True)
    for _ in range(12):
        train_step()
    # a second model's optimizer in the process (torch's optimizer hooks are process-wide),
    # stepping between this model's forward and its backward, and after its optimizer step
    other = torch.nn.Linear(4, 4)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.01)

    def other_step() -> None:
        other_opt.zero_grad()
        other(data[0][1]).sum().backward()
        other_opt.step()

    for i in range(6):
        out = ddp(data[i][0])
        other_step()
        opt.zero_grad()
        ((out - data[i][1]) ** 2).mean().backward()
        opt.step()
        other_step()
    train_step()
    # the change of step was bound where the routine forward runs (its one C call), and it opens
    # only the OpenStep it knows
    native = monitor.hooks.native
    assert native is not None and (native.step_change is not None) == routine
    for cls in (lambda *a: None, type("Other", (), {"__slots__": ("index",)})):
        try:
            native._module.step_changer(native.ring, monitor.hooks.opt_stamps, cls)
        except TypeError:
            pass
        else:
            raise AssertionError(f"step_changer took {cls!r} for OpenStep")
    monitor.close()
    kept = [
        _shape(r)
        for r in sink.records
        # a finding's wording and evidence carry measured times; a process sample is the clock's
        if not isinstance(r, (Header, ProcSample, FindingRecord, End))
    ]
    # (routine forwards, forwards in all, records built from packed marks)
    return kept, taken[1] - taken[0], taken[1], packed[0]


def test_the_routine_forward_writes_what_the_full_path_writes() -> None:
    full = run_ranks(_train, 2, args=(False,), timeout=240)
    routine = run_ranks(_train, 2, args=(True,), timeout=240)
    for rank in range(2):
        full_records, full_taken, forwards, full_packed = full[rank]
        records, taken, _, packed = routine[rank]
        assert full_taken == full_packed == 0
        # the routine forward's steps have their marks packed (its change of step), none of the full path's
        assert packed >= taken // 2, (packed, taken)
        # most forwards take the routine path; the rest (micro-steps, evaluation, the forward
        # after a sample began, a closure's) take the full one
        assert taken >= forwards // 2, (taken, forwards)
        kinds = [kind for kind, _ in records]
        assert kinds.count("step") >= 40 and "GradFlags" in kinds and "Fingerprint" in kinds
        assert len(records) == len(full_records)
        # records in their order, but for the sampled checks' (fingerprints, unused parameters):
        # the log reads those in any order relative to the steps, so the monitor emits them
        # without the closed steps going first, and where they fall among the steps depends on
        # when each path emitted its batch. Their own order, kind by kind, is the same.
        for kind in (None, "Fingerprint", "Unused"):
            a_of, b_of = (
                [r for r in rs if (r[0] not in ("Fingerprint", "Unused") if kind is None else r[0] == kind)]
                for rs in (full_records, records)
            )
            assert len(a_of) == len(b_of), (rank, kind)
            for i, (a, b) in enumerate(zip(a_of, b_of, strict=True)):
                assert a == b, (rank, kind, i, a, b)
