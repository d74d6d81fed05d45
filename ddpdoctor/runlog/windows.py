"""Window records (the compact log's per-step columns) read back as ``Step`` objects.

A row becomes a ``Step`` with ``summary=True``: the phases, start and clocks of the step as the
full record had them (to the µs), empty per-bucket arrays, and ``b_count``,
``b_first_ready_us``, ``b_last_ready_us``, ``b_bytes_total`` for what the row kept of the buckets.
"""

from __future__ import annotations

from collections.abc import Container
from itertools import accumulate
from typing import Any

from ddpdoctor.events import Step, Window

_COLUMNS = (
    ("fwd_start", "fwd_start_us"),
    ("fwd", "fwd_us"),
    ("bcast_start", "bcast_start_us"),
    ("bcast", "bcast_us"),
    ("fwd_end", "fwd_end_us"),
    ("bwd_end", "bwd_end_us"),
    ("ready_first", "b_first_ready_us"),
    ("ready_last", "b_last_ready_us"),
    ("sync_end", "sync_end_us"),
    ("opt_start", "opt_start_us"),
    ("opt_end", "opt_end_us"),
    ("end", "end_us"),
)


def _float(v: int | None) -> float | None:
    return None if v is None else float(v)


def window_steps(w: Window, keep: Container[int] | None = None) -> list[Step]:
    """The window's rows as steps, in step order (``keep``: only the steps it contains).

    A column shorter than ``n`` (a hand-edited or truncated record) reads as null past its end.
    """
    n = w.n
    starts = list(accumulate(w.t0)) if w.t0 else [0] * n
    columns = []
    for name, field in _COLUMNS:
        values = getattr(w, name)
        columns.append((field, values if len(values) >= n else list(values) + [None] * (n - len(values))))
    wall = w.wall if len(w.wall) >= n else [0] * n
    micro = w.micro if len(w.micro) >= n else [0] * n
    skew = w.t0_wall_ns - w.t0_mono_ns
    out = []
    for i in range(min(n, len(starts))):
        step = w.step + i
        if keep is not None and step not in keep:
            continue
        mono = w.t0_mono_ns + starts[i] * 1000
        fields: dict[str, Any] = {field: _float(values[i]) for field, values in columns}
        out.append(
            Step(
                rank=w.rank,
                ddp=w.ddp,
                step=step,
                t0_mono_ns=mono,
                t0_wall_ns=mono + skew + wall[i] * 1000,
                micro=micro[i],
                fwd_start_us=fields.pop("fwd_start_us") or 0.0,
                bcast_bytes=w.bcast_bytes,
                clock=w.clock,
                summary=True,
                b_count=w.buckets,
                b_bytes_total=w.bytes,
                **fields,
            )
        )
    return out
