"""Realistic synthetic rank records, in the real log format (no torch, no training).

One step of the synthetic job: data loading, a forward that starts with the buffer broadcast,
a backward whose ``buckets`` gradient buckets become ready one after another, each bucket's
all-reduce completing when the last rank is ready plus the transfer time, then the optimizer.
Every rank has its own wall-clock offset (so the reader must align clocks) and its own jitter.
A planted straggler's backward is ``straggler_ms`` slower: it is ready late at every bucket and
the other ranks wait for it inside the all-reduces, while the step totals stay even. A planted
slow node (``slow_node``: every rank of that host, ``RANKS_PER_NODE`` a host) has a forward
``slow_node_ms`` slower: its ranks are late together, so none of them is much later than the
next (the blame's margins stay small) while all of them are out of line with the other hosts.
A planted dead rank (``dead``) stops logging after ``dead_at`` steps without an end record, as a
killed process does.

Everything is a pure function of (rank, step, seed), so a rank's records can be generated
without the others and one rank's file matches what the others' files say.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from ddpdoctor.events import (
    SCHEMA_VERSION,
    BucketInfo,
    BufferInfo,
    End,
    Fingerprint,
    Header,
    Layout,
    ParamInfo,
    ProcSample,
    Record,
    Step,
    Unused,
)

T0_WALL_NS = 1_800_000_000_000_000_000
T0_MONO_NS = 5_000_000_000_000
DATA_MS, FWD_MS, BCAST_MS, BWD_MS, COMM_MS, OPT_MS = 6.0, 25.0, 1.2, 50.0, 3.0, 5.0
JITTER_MS = 0.8
BUCKET_BYTES = 4 << 20
RANKS_PER_NODE = 8


@dataclass(frozen=True)
class Planted:
    """What is planted in a synthetic run: a straggler rank (slow backward), a slow node (slow
    forward on every rank of one host), both by how many ms."""

    straggler: int | None = None
    straggler_ms: float = 30.0
    slow_node: int | None = None
    slow_node_ms: float = 15.0

    def delays(self, rank: int) -> tuple[float, float]:
        """(forward, backward) delay of ``rank`` in ms."""
        fwd = self.slow_node_ms if self.slow_node is not None and rank // RANKS_PER_NODE == self.slow_node else 0.0
        bwd = self.straggler_ms if rank == self.straggler else 0.0
        return fwd, bwd

    def delayed(self) -> list[tuple[float, float]]:
        """The (forward, backward) delays of the planted ranks (the ones the others wait for)."""
        out = []
        if self.straggler is not None:
            out.append((0.0, self.straggler_ms))
        if self.slow_node is not None:
            out.append((self.slow_node_ms, 0.0))
        return out

    def extra_ms(self) -> float:
        """How much longer every step is for what is planted (the others wait for the latest)."""
        return max((f + b for f, b in self.delayed()), default=0.0)


def _rng(*key: int) -> random.Random:
    return random.Random(hash(key))


def clock_offset_ns(rank: int, seed: int = 0) -> int:
    """This rank's wall-clock error (up to +-20 ms, as NTP-synced hosts have)."""
    return int(_rng(seed, rank, -1).uniform(-20e6, 20e6)) if rank else 0


def step_ms(straggler_ms: float = 0.0) -> float:
    """Nominal step time (ms)."""
    return DATA_MS + FWD_MS + BWD_MS + COMM_MS + OPT_MS + straggler_ms


def header(rank: int, world: int, *, buckets: int = 8, run_id: str = "synth") -> Header:
    params = [
        ParamInfo(
            name=f"layers.{i}.weight", shape=[1024, 512], dtype="torch.float32", numel=524_288, requires_grad=True
        )
        for i in range(buckets * 2)
    ]
    return Header(
        rank=rank,
        schema=SCHEMA_VERSION,
        run_id=run_id,
        world_size=world,
        local_rank=rank % RANKS_PER_NODE,
        host=f"node{rank // RANKS_PER_NODE:03d}",
        pid=10_000 + rank,
        backend="nccl",
        device=f"cuda:{rank % 8}",
        torch="2.13.0",
        python="3.11",
        t_mono_ns=T0_MONO_NS,
        t_wall_ns=T0_WALL_NS + clock_offset_ns(rank),
        ddp_options={"bucket_cap_mb": 25, "broadcast_buffers": True, "find_unused_parameters": False},
        params=params,
        buffers=[BufferInfo(name="norm.running_mean", shape=[512], dtype="torch.float32", bytes=2048, broadcast=True)],
    )


def layout(rank: int, *, buckets: int = 8) -> Layout:
    return Layout(
        rank=rank,
        step=0,
        reason="initial",
        buckets=[
            BucketInfo(
                index=b,
                params=[f"layers.{2 * b}.weight", f"layers.{2 * b + 1}.weight"],
                bytes=BUCKET_BYTES,
                dtype="torch.float32",
            )
            for b in range(buckets)
        ],
    )


def step_record(
    rank: int,
    world: int,
    step: int,
    *,
    buckets: int = 8,
    straggler: int | None = None,
    straggler_ms: float = 30.0,
    seed: int = 0,
    planted: Planted | None = None,
) -> Step:
    """Rank ``rank``'s record of ``step`` (``planted``, where given, instead of ``straggler``)."""
    if planted is None:
        planted = Planted(straggler=straggler, straggler_ms=straggler_ms)
    period = step_ms(planted.extra_ms())
    mine = _rng(seed, rank, step)
    start_ms = step * period + mine.uniform(0, JITTER_MS)  # on the true clock
    slow_fwd, slow_bwd = planted.delays(rank)
    data = DATA_MS + mine.uniform(0, JITTER_MS)
    bcast_start = data + 0.2
    fwd_end = data + FWD_MS + slow_fwd + mine.uniform(0, JITTER_MS)
    bwd_ms = BWD_MS + slow_bwd + mine.uniform(0, JITTER_MS)
    ready = [fwd_end + bwd_ms * (b + 1) / buckets - mine.uniform(0, 0.3) for b in range(buckets)]
    # the all-reduce completes when the last rank is ready (a planted one, if any), on the true clock
    late = planted.delayed() or [(0.0, 0.0)]
    done_true = [
        step * period
        + DATA_MS
        + JITTER_MS
        + FWD_MS
        + JITTER_MS
        + max(f + (BWD_MS + b_ms + JITTER_MS) * (b + 1) / buckets for f, b_ms in late)
        + COMM_MS
        for b in range(buckets)
    ]
    done = [max(r + 0.05, d - start_ms) for r, d in zip(ready, done_true, strict=True)]
    sync_end = max(done)
    opt_end = sync_end + 0.1 + OPT_MS
    us = 1000.0
    return Step(
        rank=rank,
        step=step,
        t0_mono_ns=T0_MONO_NS + int(start_ms * 1e6),
        t0_wall_ns=T0_WALL_NS + int(start_ms * 1e6) + clock_offset_ns(rank, seed),
        fwd_start_us=round(data * us, 3),
        fwd_us=round((fwd_end - data - BCAST_MS) * us, 3),
        bcast_start_us=round(bcast_start * us, 3),
        bcast_us=BCAST_MS * us,
        bcast_bytes=2048,
        fwd_end_us=round(fwd_end * us, 3),
        bwd_end_us=round((fwd_end + bwd_ms) * us, 3),
        b_ready_us=[round(t * us, 3) for t in ready],
        b_launch_us=[round((t + 0.02) * us, 3) for t in ready],
        b_done_us=[round(t * us, 3) for t in done],
        b_bytes=[BUCKET_BYTES] * buckets,
        sync_end_us=round(sync_end * us, 3),
        opt_start_us=round((sync_end + 0.1) * us, 3),
        opt_end_us=round(opt_end * us, 3),
        end_us=round(period * us, 3),
    )


def rank_records(
    rank: int,
    world: int,
    steps: int,
    *,
    buckets: int = 8,
    straggler: int | None = None,
    straggler_ms: float = 30.0,
    seed: int = 0,
    end: bool = True,
    planted: Planted | None = None,
    dead: int | None = None,
    dead_at: int | None = None,
) -> Iterator[Record]:
    """Everything one rank logs over ``steps`` steps: header, layout, steps, process samples,
    fingerprints and unused-parameter checks at the sampled steps, and the end record. Rank
    ``dead`` stops after ``dead_at`` steps (default: three quarters of them) with no end record."""
    if planted is None:
        planted = Planted(straggler=straggler, straggler_ms=straggler_ms)
    if rank == dead:
        steps, end = (dead_at if dead_at is not None else steps * 3 // 4), False
    yield header(rank, world, buckets=buckets)
    yield layout(rank, buckets=buckets)
    period_ns = int(step_ms(planted.extra_ms()) * 1e6)
    norms = [1.0 + i / 10 for i in range(buckets * 2)]
    bits = [0x1F3A5C7E9B2D4 + 977 * i for i in range(buckets * 2)]  # (53-bit values, as the runtime's)
    for i in range(steps):
        yield step_record(rank, world, i, buckets=buckets, seed=seed, planted=planted)
        if i % 20 == 0:
            yield ProcSample(
                rank=rank,
                t_mono_ns=T0_MONO_NS + i * period_ns,
                t_wall_ns=T0_WALL_NS + i * period_ns,
                cpu_pct=99.0,
                rss_bytes=3 << 30,
            )
        if i in (0, 1, 3) or i % 50 == 0:
            yield Fingerprint(
                rank=rank,
                step=i,
                param_norms=norms,
                param_bits=bits,
                buffer_norms=[0.5],
                buffer_sums=[0.5],
                buffer_bits=[0x10E0000000000],
                buffer_versions=[i],
                after_broadcast=True,
            )
            yield Unused(rank=rank, step=i, names=[], post_forward_us=12.0)
    if end:
        yield End(
            rank=rank,
            t_mono_ns=T0_MONO_NS + steps * period_ns,
            t_wall_ns=T0_WALL_NS + steps * period_ns,
            steps=steps,
            reason="close",
        )
