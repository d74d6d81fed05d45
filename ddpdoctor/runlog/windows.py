"""Window records (the compact log's per-step columns) read back as ``Step`` objects.

A row becomes a ``Step`` with ``summary=True``: the phases, start and clocks of the step as the
full record had them (to the µs), empty per-bucket arrays, and ``b_count``,
``b_first_ready_us``, ``b_last_ready_us``, ``b_bytes_total`` for what the row kept of the buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

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


def _column(w: Window, name: str, n: int) -> list[int | None]:
    values: list[int | None] = getattr(w, name)
    return values if len(values) >= n else values + [None] * (n - len(values))


def window_steps(w: Window, rows: Sequence[int] | None = None) -> list[Step]:
    """The window's rows as steps, in step order (``rows``: only these row indices, ascending).

    A column shorter than ``n`` (a hand-edited or truncated record) reads as null past its end.
    """
    whole = min(w.n, len(w.t0)) if w.t0 else w.n
    n = whole
    if rows is None:
        rows = range(n)
    elif not rows:
        return []
    else:  # (a sampled read keeps a row or two of a window: its columns up to the last of them)
        n = min(n, rows[-1] + 1)
    starts = list(accumulate(w.t0[:n])) if w.t0 else [0] * n
    (fs, fwd, bs, bc, fe, be, rf, rl, se, os_, oe, end) = (_column(w, name, n) for name, _ in _COLUMNS)
    wall = w.wall if len(w.wall) >= whole else [0] * n
    micro = w.micro if len(w.micro) >= whole else [0] * n
    skew = w.t0_wall_ns - w.t0_mono_ns
    rank, ddp, first, mono0 = w.rank, w.ddp, w.step, w.t0_mono_ns
    bcast_bytes, clock, count, nbytes = w.bcast_bytes, w.clock, w.buckets, w.bytes
    out = []
    for i in rows:
        if i >= n:
            break
        mono = mono0 + starts[i] * 1000
        out.append(
            Step(
                rank=rank,
                ddp=ddp,
                step=first + i,
                t0_mono_ns=mono,
                t0_wall_ns=mono + skew + wall[i] * 1000,
                micro=micro[i],
                fwd_start_us=float(fs[i] or 0),
                fwd_us=_f(fwd[i]),
                bcast_start_us=_f(bs[i]),
                bcast_us=_f(bc[i]),
                bcast_bytes=bcast_bytes,
                fwd_end_us=_f(fe[i]),
                bwd_end_us=_f(be[i]),
                sync_end_us=_f(se[i]),
                opt_start_us=_f(os_[i]),
                opt_end_us=_f(oe[i]),
                end_us=_f(end[i]),
                clock=clock,
                summary=True,
                b_count=count,
                b_first_ready_us=_f(rf[i]),
                b_last_ready_us=_f(rl[i]),
                b_bytes_total=nbytes,
            )
        )
    return out


def _f(v: int | None) -> float | None:
    return None if v is None else float(v)
