"""The ring's drain into a step (the extension's ``drain_into``, drain.h) against its Python twin.

Two real gloo ranks train with the native comm hook registered on DDP's reducer. After each
backward the ring's entries are read without taking them (``peek``), then drained into an
``OpenStep`` by C++; the same entries, handed to ``StepRecorder.add_bucket_columns`` and
``backward_end`` as the columns ``drain_columns`` gives, must leave an equal step. A step that
already holds more buckets than the ring is left to Python by both: C++ returns the columns, and
they must equal the entries read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpdoctor.runtime.step import native_hook
from ddpdoctor.runtime.step.recorder import OpenStep, StepRecorder
from tests.ddp_harness import run_ranks
from tests.models import batches, make_model
from tests.runtime_workers import BUCKET_CAP_MB

OFFSET = 1_000  # the tests' clock offset: added to every mark by both


def _marks(step: OpenStep) -> tuple[Any, ...]:
    return step.ready, step.launch, step.done, step.nbytes, step.bwd_end


def _held_step(index: int, held: int) -> OpenStep:
    """An OpenStep that holds ``held`` buckets not seen (None marks)."""
    step = OpenStep(index, 0)
    step.ready, step.launch, step.done, step.nbytes = [None] * held, [None] * held, [None] * held, [None] * held
    return step


def _python_step(index: int, columns: tuple[Any, ...], held: int) -> OpenStep:
    """``_held_step`` with ``columns`` placed by Python's rule."""
    indices, ready, launch, done, nbytes, in_order, end = columns
    step = _held_step(index, held)
    recorder = StepRecorder(0, 0, lambda record: None)
    recorder.add_bucket_columns(step, indices, ready, launch, done, nbytes, in_order)
    if end is not None:
        recorder.backward_end(step, end)
    return step


def drain_parity(rank: int, world_size: int) -> dict[str, Any]:
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    timing = native_hook.load().register_timed_hook(ddp.reducer, ddp.process_group, native_hook.RING_CAPACITY)
    drain = timing.drain_into
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    compared: list[tuple[Any, Any]] = []
    left_to_python: list[tuple[Any, Any]] = []
    for i, (x, y) in enumerate(batches(rank, 6)):
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        entries = timing.peek()  # (index, ready, launch, done, bytes), on the hook's clock
        end = timing.backward_end()
        indices = [e[0] for e in entries]
        columns = (
            indices,
            [e[1] + OFFSET for e in entries],
            [e[2] + OFFSET for e in entries],
            [e[3] + OFFSET if e[3] else None for e in entries],
            [e[4] for e in entries],
            indices == list(range(len(entries))),
            end + OFFSET if end else None,
        )
        held = len(entries) + 1 if i % 2 else 0  # odd steps: the step holds one bucket more
        native = _held_step(i, held)
        returned = drain(native, OFFSET)
        if held:
            left_to_python.append((returned, columns))
            native = _python_step(i, returned, held)
        else:
            assert returned is None, returned
        compared.append((_marks(native), _marks(_python_step(i, columns, held))))
    return {"compared": compared, "left_to_python": left_to_python}


def test_the_drain_in_cpp_leaves_the_step_python_leaves(native_built: Path) -> None:
    for r in run_ranks(drain_parity, 2, timeout=240):
        assert len(r["compared"]) == 6
        for native, python in r["compared"]:
            assert native == python
            ready, launch, done, nbytes, bwd_end = native
            assert ready and all(isinstance(m, int) for m in done[: len(ready) - 1])
            assert bwd_end is not None
        # one bucket at the first step, several once DDP rebuilt them
        assert max(len(native[0]) for native, _ in r["compared"]) >= 2
        assert len(r["left_to_python"]) == 3
        for returned, columns in r["left_to_python"]:
            assert tuple(returned) == columns
