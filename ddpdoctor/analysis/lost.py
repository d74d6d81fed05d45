"""rank-lost: a rank's stream ended without an end record while other ranks went on.

A rank that is killed (SIGKILL, the OOM killer, a native crash) never writes its end record. If
another rank did close its log (it finished, or failed when the lost rank vanished from its
collectives, which gloo notices at once), or logged on for GRACE_S after it, the rank was lost;
when no rank closed and all stopped together, the job may still run or was killed whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.groups import ranks_named
from ddpdoctor.events import End, Header, ProcSample, Step

#: A rank is lost when another rank logged this long after its last record.
GRACE_S = 5.0


@dataclass(frozen=True)
class RankTail:
    """What ``lost_ranks`` needs of one rank: the latest of its records (any may be None)."""

    header: Header | None = None
    last_step: Step | None = None
    last_proc: ProcSample | None = None
    end: End | None = None

    @property
    def last_wall_ns(self) -> int | None:
        """The wall time of its newest record."""
        times = []
        if self.last_step is not None:
            s = self.last_step
            times.append(s.t0_wall_ns + int((s.end_us or s.sync_end_us or 0.0) * 1000))
        if self.last_proc is not None:
            times.append(self.last_proc.t_wall_ns)
        if self.end is not None:
            times.append(self.end.t_wall_ns)
        if self.header is not None:
            times.append(self.header.t_wall_ns)
        return max(times) if times else None


def lost_ranks(tails: Mapping[int, RankTail]) -> list[Finding]:
    """Ranks whose log stops, with no end record, well before another rank's log does."""
    last = {r: tail.last_wall_ns for r, tail in tails.items()}
    known = {r: t for r, t in last.items() if t is not None}
    if len(known) < 2:
        return []
    latest = max(known.values())
    closed = {r for r, tail in tails.items() if tail.end is not None}
    out = []
    for rank, log in sorted(tails.items()):
        t = known.get(rank)
        if log.end is not None:
            continue
        # another rank closed its monitor (finished, or failed when this one vanished from its
        # collectives) and this one never did; or the others logged on long after it stopped
        if not (closed - {rank}) and t is not None and (latest - t) / 1e9 < GRACE_S:
            continue
        if t is None:  # nothing reached the file: it died within its first flush interval
            t = min(known.values())
        last_step = log.last_step.step if log.last_step is not None else None
        others = sorted(closed - {rank}) or sorted(r for r in known if r != rank)
        after = f"after step {last_step}" if last_step is not None else "before its first steps reached its log"
        failed = {r: tails[r].end.reason for r in others if tails[r].end is not None}  # type: ignore[union-attr]
        failed = {r: why for r, why in failed.items() if why.startswith("error")}
        then = (
            f"{ranks_named(sorted(failed))} then failed in {'its' if len(failed) == 1 else 'their'} next collective "
            f"({', '.join(sorted(set(failed.values())))}: the backend noticed the lost peer)"
            if failed
            else "the other ranks' collectives waited for it from there on"
        )
        out.append(
            Finding(
                code="rank-lost",
                severity="error",
                ranks=[rank],
                step=last_step,
                title=f"rank {rank} stopped logging {after}, with no end record, while the others went on",
                detail=(
                    f"Rank {rank}'s log ends without an end record (killed: SIGKILL, out of memory, a crash in "
                    f"native code) while {ranks_named(others)} went on ({(latest - t) / 1e9:.1f} s more of "
                    f"{'its' if len(others) == 1 else 'their'} records). Its records up to then are intact (steps "
                    f"still batched in memory are lost); {then}."
                ),
                evidence={
                    "last_step": last_step,
                    "last_record_wall_ns": t,
                    "seconds_before_others_ended": (latest - t) / 1e9,
                    "host": log.header.host if log.header else None,
                    "pid": log.header.pid if log.header else None,
                },
                fix=(
                    f"Look at rank {rank}'s stderr and the kernel log on its host (dmesg: the OOM killer) "
                    f"for pid {log.header.pid if log.header else '?'}; torchrun's --max-restarts restarts a job whose "
                    "rank died."
                ),
            )
        )
    return out
