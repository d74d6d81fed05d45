"""rank-lost: a rank's stream ended without an end record while other ranks went on.

A rank that is killed (SIGKILL, the OOM killer, a native crash) never writes its end record. If
another rank did close its log (it finished, or failed when the lost rank vanished from its
collectives, which gloo notices at once), or logged on for GRACE_S after it, the rank was lost;
when no rank closed and all stopped together, the job may still run or was killed whole.
"""

from __future__ import annotations

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.runlog import RankLog, Run

#: A rank is lost when another rank logged this long after its last record.
GRACE_S = 5.0


def _last_wall_ns(log: RankLog) -> int | None:
    times = []
    if log.steps:
        s = log.steps[-1]
        times.append(s.t0_wall_ns + int((s.end_us or s.sync_end_us or 0.0) * 1000))
    if log.procs:
        times.append(log.procs[-1].t_wall_ns)
    if log.end is not None:
        times.append(log.end.t_wall_ns)
    if log.header is not None:
        times.append(log.header.t_wall_ns)
    return max(times) if times else None


def lost_ranks(run: Run) -> list[Finding]:
    """Ranks whose log stops, with no end record, well before another rank's log does."""
    last = {r: _last_wall_ns(log) for r, log in run.ranks.items()}
    known = {r: t for r, t in last.items() if t is not None}
    if len(known) < 2:
        return []
    latest = max(known.values())
    closed = {r for r, log in run.ranks.items() if log.end is not None}
    out = []
    for rank, log in sorted(run.ranks.items()):
        t = known.get(rank)
        if log.end is not None:
            continue
        # another rank closed its monitor (finished, or failed when this one vanished from its
        # collectives) and this one never did; or the others logged on long after it stopped
        if not (closed - {rank}) and t is not None and (latest - t) / 1e9 < GRACE_S:
            continue
        if t is None:  # nothing reached the file: it died within its first flush interval
            t = min(known.values())
        last_step = log.steps[-1].step if log.steps else None
        others = [r for r in known if r != rank]
        out.append(Finding(
            code="rank-lost", severity="error", ranks=[rank], step=last_step,
            title=f"rank {rank} stopped logging after step {last_step} while the others went on",
            detail=(f"Rank {rank}'s log ends without an end record (killed: SIGKILL, out of memory, a crash in "
                    f"native code) while ranks {sorted(closed - {rank}) or others} went on "
                    f"({(latest - t) / 1e9:.1f} s more of their records). Its "
                    "records up to then are intact; the other ranks' collectives waited for it from there on."),
            evidence={"last_step": last_step, "last_record_wall_ns": t, "seconds_before_others_ended": (latest - t) / 1e9,
                      "host": log.header.host if log.header else None, "pid": log.header.pid if log.header else None},
            fix=(f"Look at rank {rank}'s stderr and the kernel log on its host (dmesg: the OOM killer) "
                 f"for pid {log.header.pid if log.header else '?'}; torchrun's --max-restarts restarts a job whose "
                 "rank died."),
        ))
    return out
