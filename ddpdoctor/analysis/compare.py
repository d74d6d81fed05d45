"""Two runs side by side: did a change make DDP slower, where, and is it more than noise?

``compare(base, new)`` takes two loaded runs (and their reports) and returns a ``Comparison``:

- per phase (``phases.PHASES`` plus the cross-rank bucket wait), the median over steps of each
  run, the change, and a confidence that the change is not noise. Each step gives one sample:
  the slowest rank's value at that step (a synchronized step is as slow as its slowest rank;
  the bucket wait is each DDP group's own, its clocks aligned within it, as the report's).
  The confidence is ``1 - p`` of a two-sided Mann-Whitney U test over the two runs' steps, so
  it comes from the runs' own step-to-step spread, needs no assumption about its shape, and a
  single outlier step cannot make it;
- per bucket, the median time from backward start to the bucket being ready, and its
  all-reduce time (ready to done);
- the findings that are new in ``new``, resolved (in ``base`` only) or unchanged.

Pure Python: no scipy, no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

from ddpdoctor.analysis.findings import SEVERITY_ORDER, Finding
from ddpdoctor.analysis.groups import ddp_groups, group_arrivals
from ddpdoctor.analysis.phases import step_phases
from ddpdoctor.analysis.report import REPORTED, Report
from ddpdoctor.events import Step
from ddpdoctor.runlog import Run

#: Phases compared, in timeline order ("bucket_wait" is cross-rank: blocked waiting for slower ranks).
COMPARED = REPORTED
#: A change is called slower/faster only with at least this confidence ...
CONFIDENCE = 0.95
#: ... and when it is at least this large, both in ms and in % of the base: a phase of a few
#: microseconds can double without anyone caring.
MIN_CHANGE_MS = 0.1
MIN_CHANGE_PCT = 2.0
#: ... and, for a phase within the step, at least this much of the base run's step time: a phase
#: of 0.2 ms that moves by 0.1 ms in a 27 ms step changes nothing anyone would gate a merge on.
MIN_CHANGE_STEP_PCT = 1.0
#: The first steps include DDP's first iteration (bucket rebuild, allocator warm-up): left out
#: when the run has enough steps without them.
WARMUP_STEPS = 2
MIN_STEPS_AFTER_WARMUP = 6


@dataclass
class PhaseChange:
    """One phase in both runs (ms, medians over steps of the slowest rank's value)."""

    phase: str
    base_ms: float | None
    new_ms: float | None
    change_ms: float | None
    change_pct: float | None
    confidence: float | None  # 1 - p of a two-sided Mann-Whitney U test over steps; None: too few steps
    verdict: str  # "slower", "faster", "same", or "n/a"
    base_steps: int
    new_steps: int


@dataclass
class BucketChange:
    """One gradient bucket in both runs (ms; ready is measured from the end of forward)."""

    index: int
    base_bytes: int | None
    new_bytes: int | None
    base_ready_ms: float | None
    new_ready_ms: float | None
    base_allreduce_ms: float | None
    new_allreduce_ms: float | None


@dataclass
class FindingChange:
    """A finding code present in one run or both."""

    code: str
    status: str  # "new", "resolved", "unchanged"
    severity: str  # in the run where it is (the new run's when in both)
    base_severity: str | None
    title: str
    fix: str
    ranks: list[int] = field(default_factory=list)


@dataclass
class Comparison:
    """What ``ddpdoctor compare`` shows; ``to_dict()`` is its JSON."""

    base: dict[str, Any]
    new: dict[str, Any]
    phases: list[PhaseChange]
    buckets: list[BucketChange]
    buckets_note: str | None
    ranks: list[dict[str, Any]]
    findings: list[FindingChange]

    def to_dict(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "new": self.new,
            "confidence_level": CONFIDENCE,
            "phases": [asdict(p) for p in self.phases],
            "buckets": [asdict(b) for b in self.buckets],
            "buckets_note": self.buckets_note,
            "ranks": self.ranks,
            "findings": [asdict(f) for f in self.findings],
        }

    def phase(self, name: str) -> PhaseChange | None:
        return next((p for p in self.phases if p.phase == name), None)

    def regressions(self, pct: float, phases: list[str] | None = None) -> list[PhaseChange]:
        """Phases (``phases``, default all) slower by more than ``pct`` % with confidence."""
        wanted = set(phases) if phases else None
        return [
            p
            for p in self.phases
            if (wanted is None or p.phase in wanted)
            and p.verdict == "slower"
            and p.change_pct is not None
            and p.change_pct > pct
        ]

    def new_problems(self) -> list[FindingChange]:
        """Findings of severity warning or error that BASE did not have at all.

        A code in both runs whose severity changed is shown (``base_severity``) but is not a new
        problem: several severities depend on a measured share of the step (e.g. the buffer
        broadcast's cost around 1%), and a CI gate must not flip on that noise.
        """
        return [
            f
            for f in self.findings
            if f.status == "new" and SEVERITY_ORDER.get(f.severity, 0) >= SEVERITY_ORDER["warning"]
        ]


# -- statistics ---------------------------------------------------------------------------------


def mann_whitney_p(a: list[float], b: list[float]) -> float | None:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation with tie and
    continuity corrections); None when either sample has fewer than 3 values.

    The approximation is what scipy's ``mannwhitneyu(method="asymptotic")`` computes; at 5+
    values per side it is close to the exact test.
    """
    n1, n2 = len(a), len(b)
    if n1 < 3 or n2 < 3:
        return None
    pooled = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):  # average ranks over ties
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2.0 + 1.0
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    r1 = sum(r for r, (_, side) in zip(ranks, pooled, strict=True) if side == 0)
    u1 = r1 - n1 * (n1 + 1) / 2.0
    mu = n1 * n2 / 2.0
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return 1.0  # every value equal: no evidence of a difference
    z = (abs(u1 - mu) - 0.5) / math.sqrt(var)
    if z <= 0:
        return 1.0
    return min(1.0, math.erfc(z / math.sqrt(2.0)))


# -- samples --------------------------------------------------------------------------------------


def _kept_steps(run: Run) -> set[int]:
    """Step numbers every rank logged, warm-up left out when enough remain."""
    per_rank = [{s.step for s in log.steps} for log in run.ranks.values() if log.steps]
    if not per_rank:
        return set()
    common = set.intersection(*per_rank)
    ordered = sorted(common)
    if len(ordered) - WARMUP_STEPS >= MIN_STEPS_AFTER_WARMUP:
        ordered = ordered[WARMUP_STEPS:]
    return set(ordered)


def phase_samples(run: Run) -> dict[str, list[float]]:
    """Per phase, one value per kept step: the slowest rank's (ms)."""
    kept = _kept_steps(run)
    by_step: dict[int, dict[str, float]] = {}
    for log in run.ranks.values():
        for s in log.steps:
            if s.step not in kept:
                continue
            row = by_step.setdefault(s.step, {})
            for name, value in step_phases(s).items():
                if value is not None and name in COMPARED:
                    row[name] = max(row.get(name, value), value)
    steps_by_rank = {r: log.steps for r, log in run.ranks.items()}
    # ranks wait only for the ranks of their own DDP group: each group's waits, the longest of them
    _, arrived = group_arrivals(steps_by_rank, ddp_groups({r: log.header for r, log in run.ranks.items()}))
    for group_arrived in arrived:
        for sa in group_arrived:
            if sa.step in by_step and sa.wait_us:
                wait = max(sa.wait_us.values()) / 1000.0
                by_step[sa.step]["bucket_wait"] = max(by_step[sa.step].get("bucket_wait", wait), wait)
    out: dict[str, list[float]] = {name: [] for name in COMPARED}
    for step in sorted(by_step):
        for name, value in by_step[step].items():
            out[name].append(value)
    return out


def _bucket_stats(run: Run) -> list[tuple[int, float | None, float | None]]:
    """Per bucket: (bytes, median ready ms after forward end, median ready-to-done ms), over ranks and kept steps."""
    kept = _kept_steps(run)
    ready: list[list[float]] = []
    reduce_: list[list[float]] = []
    sizes: list[int] = []
    for log in run.ranks.values():
        for s in log.steps:
            if s.step not in kept or not s.b_ready_us:
                continue
            _grow(ready, reduce_, sizes, s)
            for i, t in enumerate(s.b_ready_us):
                if t is None:
                    continue
                if s.fwd_end_us is not None:
                    ready[i].append((t - s.fwd_end_us) / 1000.0)
                done = s.b_done_us[i] if i < len(s.b_done_us) else None
                if done is not None:
                    reduce_[i].append((done - t) / 1000.0)
    return [(sizes[i], _med(ready[i]), _med(reduce_[i])) for i in range(len(sizes))]


def _grow(ready: list[list[float]], reduce_: list[list[float]], sizes: list[int], s: Step) -> None:
    while len(sizes) < len(s.b_ready_us):
        i = len(sizes)
        sizes.append(s.b_bytes[i] if i < len(s.b_bytes) else 0)
        ready.append([])
        reduce_.append([])


def _med(values: list[float]) -> float | None:
    return round(median(values), 3) if values else None


# -- comparison -----------------------------------------------------------------------------------


def compare_phase(name: str, a: list[float], b: list[float], step_ms: float | None = None) -> PhaseChange:
    """One phase's change, with its confidence and verdict (``step_ms``: the base run's median
    step, for the floor of a phase within it)."""
    base, new = _med(a), _med(b)
    if base is None or new is None:
        return PhaseChange(name, base, new, None, None, None, "n/a", len(a), len(b))
    change = round(new - base, 3)
    pct = round(100.0 * change / base, 1) if base > 0 else (0.0 if change == 0 else None)
    p = mann_whitney_p(a, b)
    confidence = None if p is None else round(1.0 - p, 4)
    big = abs(change) >= MIN_CHANGE_MS and (pct is None or abs(pct) >= MIN_CHANGE_PCT)
    if step_ms is not None and name != "step":
        big = big and abs(change) >= step_ms * MIN_CHANGE_STEP_PCT / 100.0
    if confidence is None:
        verdict = "n/a"
    elif confidence >= CONFIDENCE and big:
        verdict = "slower" if change > 0 else "faster"
    else:
        verdict = "same"
    return PhaseChange(name, base, new, change, pct, confidence, verdict, len(a), len(b))


def _findings(base: list[Finding], new: list[Finding]) -> list[FindingChange]:
    def by_code(fs: list[Finding]) -> dict[str, Finding]:
        out: dict[str, Finding] = {}
        for f in fs:  # one per code after diagnose's merge; keep the most severe otherwise
            old = out.get(f.code)
            if old is None or SEVERITY_ORDER[f.severity] > SEVERITY_ORDER[old.severity]:
                out[f.code] = f
        return out

    a, b = by_code(base), by_code(new)
    out = []
    for code, f in b.items():
        old = a.get(code)
        out.append(
            FindingChange(
                code,
                "unchanged" if old else "new",
                f.severity,
                old.severity if old else None,
                f.title,
                f.fix,
                list(f.ranks),
            )
        )
    for code, f in a.items():
        if code not in b:
            out.append(FindingChange(code, "resolved", f.severity, f.severity, f.title, f.fix, list(f.ranks)))
    order = {"new": 0, "resolved": 1, "unchanged": 2}
    out.sort(key=lambda f: (order[f.status], -SEVERITY_ORDER[f.severity], f.code))
    return out


def _run_facts(report: Report) -> dict[str, Any]:
    return {
        "dir": report.run.get("dir"),
        "run_id": report.run.get("run_id"),
        "world_size": report.run.get("world_size"),
        # each DDP group's ranks, as the report has them (one group: DDP over the whole world)
        "ddp_groups": report.run.get("ddp_groups"),
        "steps": report.stats.get("steps"),
        "backend": report.run.get("backend"),
        "device": report.run.get("device"),
        "ddp_options": report.run.get("ddp_options"),
    }


def compare(base: Run, new: Run, base_report: Report, new_report: Report) -> Comparison:
    """Compare two loaded runs (``load_run``) and their reports (``analyze``)."""
    sa, sb = phase_samples(base), phase_samples(new)
    step_ms = _med(sa["step"]) if "step" in sa else None
    phases = [compare_phase(name, sa[name], sb[name], step_ms) for name in COMPARED]
    ba, bb = _bucket_stats(base), _bucket_stats(new)
    note = None
    if len(ba) != len(bb):
        note = f"the bucket layouts differ ({len(ba)} buckets in base, {len(bb)} in new): buckets compared by index"
    elif any(x[0] != y[0] for x, y in zip(ba, bb, strict=False)):
        note = "bucket sizes differ between the runs: buckets compared by index"
    buckets = []
    for i in range(max(len(ba), len(bb))):
        x = ba[i] if i < len(ba) else (None, None, None)
        y = bb[i] if i < len(bb) else (None, None, None)
        buckets.append(BucketChange(i, x[0], y[0], x[1], y[1], x[2], y[2]))
    ranks = []
    new_ranks = {r["rank"]: r for r in new_report.ranks}
    for r in base_report.ranks:
        other = new_ranks.get(r["rank"])
        ranks.append(
            {
                "rank": r["rank"],
                "base_step_ms": r["medians_ms"].get("step"),
                "new_step_ms": other["medians_ms"].get("step") if other else None,
                "base_wait_ms": r["medians_ms"].get("bucket_wait"),
                "new_wait_ms": other["medians_ms"].get("bucket_wait") if other else None,
            }
        )
    return Comparison(
        base=_run_facts(base_report),
        new=_run_facts(new_report),
        phases=phases,
        buckets=buckets,
        buckets_note=note,
        ranks=ranks,
        findings=_findings(base_report.findings, new_report.findings),
    )
