"""Blame by time lost: how much wall time each rank made the others wait, step by step.

At each step's collectives (the buffer broadcast, then every gradient bucket) the last rank to
arrive holds everyone else. What the step would have saved had that rank arrived with the
runner-up is its *margin* over the runner-up: that is the time it cost. A step's cost to a rank
is its largest margin over the step's collectives (not their sum: a rank late at the first
bucket is usually late by the same delay at every later one, and the others only block once, at
the end of backward or in the broadcast).

One rule covers steady, periodic and intermittent stragglers: a rank is named when the time it
cost is *material* (a share of the window's time and an absolute floor), however few of the
steps it was late in. Jitter is kept out three ways, all explicit here:

- the noise floor: a step's margin below ``max(NOISE_FLOOR_MS, NOISE_FLOOR_SHARE * step,
  JITTER_MADS * MAD)`` is not counted at all, MAD being the median absolute deviation of the
  window's step durations: the run's own jitter (other work on the host, a loaded machine) raises
  the floor, while a straggler, late by the same delay or late in a minority of steps, leaves
  the median step and its deviation where they were;
- jitter moves between ranks: each rank's counted time is compared with what the *other* ranks
  were blamed for over the same steps (the median of them); a rank is named only for what it
  cost beyond that, and only when it cost at least ``DOMINANCE`` times as much. A rank late in a
  pattern of its own (the next point) is a straggler, not jitter, and is left out of the others'
  noise and of their chance: two stragglers never hide each other. Both sides are
  taken less each rank's largest late step: a single late step (a hiccup, a loaded machine at
  start-up) is an incident, neither jitter that would hide a steady straggler on another rank
  nor a pattern that names its own;
- the late steps must not look like chance: either too many of them are this rank's for
  jitter that picks ranks at random (a binomial tail below ``CHANCE``), or they are far larger
  than anything the other ranks were blamed for (``MAGNITUDE`` times their median).

Step 0 is left out: its arrivals hold the ranks' start-up skew, not lateness in training.

Everything here is a pure function of the steps and arrivals it is given, so the report (the
whole run) and the live view (a sliding window) call the same code.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import exp, lgamma, log, log1p
from statistics import median
from typing import Any

from ddpdoctor.analysis.bucket_wait import StepArrivals
from ddpdoctor.events import Step

#: A step's margin (ms) below this, or below this share of the median step, is jitter: not counted.
NOISE_FLOOR_MS = 5.0
NOISE_FLOOR_SHARE = 0.10
#: ... or below this many median absolute deviations of the window's step durations.
JITTER_MADS = 3.0
#: A rank is named when what it cost beyond its largest late step and the others' jitter is at
#: least this many ms ...
MIN_LOST_MS = 200.0
#: ... and this share of the steps' wall time, ...
MIN_LOST_SHARE = 0.03
#: ... at least this many times what the median other rank was blamed for, ...
DOMINANCE = 2.0
#: ... in at least this many steps, and not by chance: the binomial tail of its late steps under
#: jitter that picks a rank at random is below ``CHANCE``, or its median margin is ``MAGNITUDE``
#: times the other ranks' (or the noise floor, if they were never late).
MIN_LATE_STEPS = 2
CHANCE = 0.01
MAGNITUDE = 3.0
#: Late steps this share of the window: "every step". Diffs this share equal: a period.
EVERY_STEP_SHARE = 0.75
PERIOD_SHARE = 0.7


@dataclass(frozen=True)
class RankBlame:
    """What one rank cost the others over a window of steps."""

    rank: int
    lost_ms: float  # sum of its counted margins over the runner-up (wall time the steps lost)
    late_steps: tuple[int, ...]  # the steps it was counted late in
    margins_ms: tuple[float, ...]  # its margin at each of those steps
    worst: tuple[int, ...]  # per late step, the index of the collective where the margin was largest
    others_waited_ms: float  # the other ranks' waiting for it, summed over them (rank-ms)
    noise_ms: float  # what the median other rank was blamed for over the same steps, less its largest late step
    named: bool  # material and not jitter


@dataclass(frozen=True)
class Blame:
    """Blame over a window: per rank, and the facts the rule was applied with."""

    steps: tuple[int, ...]  # the window's steps (every rank logged them with complete arrivals)
    step_ms: float  # median step
    window_ms: float  # the steps' wall time
    floor_ms: float  # the noise floor used
    ranks: dict[int, RankBlame]

    def named(self) -> list[RankBlame]:
        """The ranks whose cost is material, most costly first."""
        return sorted((b for b in self.ranks.values() if b.named), key=lambda b: -b.lost_ms)


def step_ms_of(steps_by_rank: Mapping[int, Sequence[Step]]) -> dict[int, float]:
    """Per step, the median over ranks of its duration (ms)."""
    per: dict[int, list[float]] = {}
    for steps in steps_by_rank.values():
        for s in steps:
            if s.end_us is not None:
                per.setdefault(s.step, []).append(s.end_us / 1000.0)
    return {k: median(v) for k, v in per.items()}


#: Per rank latest at one of a step's collectives: (its largest margin over the runner-up in ms,
#: that collective's index, the sum of the others' wait for it there in ms).
Margins = dict[int, tuple[float, int, float]]


def step_margins(sa: StepArrivals) -> Margins:
    """Per rank latest at one of this step's collectives: (its largest margin over the runner-up
    in ms, that collective's index, the sum of the others' wait for it there in ms).

    A pure function of one step's arrivals: the live view computes it once per complete step."""
    out: dict[int, tuple[float, int, float]] = {}
    ranks = list(sa.lateness_us)
    if len(ranks) < 2:
        return out
    # one column per collective; sorting a column runs in C (a report may hold 256 ranks x 10k steps)
    for b, col in enumerate(zip(*(sa.lateness_us[r] for r in ranks), strict=False)):
        ordered = sorted(col)
        top, runner_up = ordered[-1], ordered[-2]
        last = ranks[col.index(top)]
        margin = (top - runner_up) / 1000.0
        if margin > out.get(last, (-1.0, 0, 0.0))[0]:
            out[last] = (margin, b, (top * len(col) - sum(col)) / 1000.0)
    return out


def _median_without(ordered: list[float], value: float) -> float:
    """The median of sorted ``ordered`` with one occurrence of ``value`` left out (0 if none left).

    Read off ``ordered`` by index, not by copying and sorting it again: it is asked once per rank,
    O(1) each rather than O(ranks) (at 2,048 ranks the copies were most of the live view's blame)."""
    i = bisect_left(ordered, value)
    n = len(ordered) - (i < len(ordered))
    if n == 0:
        return 0.0

    def at(k: int) -> float:  # the k-th of ``ordered`` with index ``i`` left out
        return ordered[k] if k < i else ordered[k + 1]

    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


def _binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), in log space (n may be thousands of steps)."""
    if k <= n * p:
        return 1.0  # at or below the expected count: nothing unusual
    total = 0.0
    for i in range(k, n + 1):
        term = exp(lgamma(n + 1) - lgamma(i + 1) - lgamma(n - i + 1) + i * log(p) + (n - i) * log1p(-p))
        total += term
        if term < 1e-15 * total:
            break
    return min(1.0, total)


def _jitter_ms(per_step: Sequence[tuple[int, Margins]], durations: Mapping[int, float]) -> float:
    """The window's own step-to-step jitter (ms): the median absolute deviation of its step
    durations with each step's largest margin taken out (what the step would have taken had its
    latest rank arrived with the runner-up). A straggler's delay is taken out with its margin, so
    a steady, periodic or newly started straggler leaves this where it was; a loaded host, whose
    time slices stretch every rank's steps by different amounts, raises it."""
    base = [
        durations[step] - max((m for m, _, _ in at.values()), default=0.0) for step, at in per_step if step in durations
    ]
    if len(base) < 3:
        return 0.0
    middle = median(base)
    return median(abs(b - middle) for b in base)


def _not_chance(
    r: int, late: Mapping[int, list[tuple[int, float, int, float]]], ranks: list[int], events: int, floor: float
) -> bool:
    """Whether rank ``r``'s late steps are a pattern, not jitter: too many of the ``events`` late
    steps of ``ranks`` are its own for jitter that picks one of them at random (a binomial tail
    below ``CHANCE``), or its margins are ``MAGNITUDE`` times the other ranks' (or the noise floor,
    if they were never late)."""
    margins = [m for _, m, _, _ in late[r]]
    if len(margins) >= 3 and _binomial_tail(len(margins), events, 1.0 / len(ranks)) <= CHANCE:
        return True
    others = [m for o in ranks if o != r for _, m, _, _ in late[o]]
    return median(margins) >= MAGNITUDE * max(floor, median(others) if others else 0.0)


def blame(
    steps_by_rank: Mapping[int, Sequence[Step]],
    arrivals: Sequence[StepArrivals],
    durations: Mapping[int, float] | None = None,
    margins: Mapping[int, Margins] | None = None,
) -> Blame:
    """Blame by time lost over ``arrivals`` (any window of steps: the whole run, or the live view's
    recent steps); ``steps_by_rank`` gives the step durations (the same steps, or more).

    ``durations`` (step -> median ms over ranks, as ``step_ms_of``) and ``margins`` (step ->
    ``step_margins``): what the caller has already; the live view keeps both per complete step
    instead of recomputing them over its window at every check."""
    if durations is None:
        durations = step_ms_of(steps_by_rank)
    # step 0's arrivals hold the ranks' start-up skew (one rank imports, builds its model or
    # attaches later than another, by hundreds of ms): not lateness in training
    arrivals = [sa for sa in arrivals if sa.step > 0]
    window = tuple(sa.step for sa in arrivals)
    known = [durations[s] for s in window if s in durations]
    step_ms = median(known) if known else 0.0
    # a step without a duration (the last one: it ends at close) took a usual step plus its delay
    window_ms = sum(
        durations[sa.step] if sa.step in durations else step_ms + max(max(v) for v in sa.lateness_us.values()) / 1000.0
        for sa in arrivals
    )
    per_step: list[tuple[int, Margins]] = []
    for sa in arrivals:
        at = margins.get(sa.step) if margins is not None else None
        per_step.append((sa.step, at if at is not None else step_margins(sa)))
    floor = max(NOISE_FLOOR_MS, NOISE_FLOOR_SHARE * step_ms, JITTER_MADS * _jitter_ms(per_step, durations))
    ranks = sorted({r for sa in arrivals for r in sa.lateness_us} | set(steps_by_rank))
    late: dict[int, list[tuple[int, float, int, float]]] = {r: [] for r in ranks}
    for step, at in per_step:
        for r, (margin, where, waited) in at.items():
            if margin >= floor:
                late.setdefault(r, []).append((step, margin, where, waited))
    lost = {r: sum(m for _, m, _, _ in v) for r, v in late.items()}
    # a single late step is an incident (a hiccup: a loaded machine at start-up), neither jitter nor
    # a straggler's pattern: each rank is judged on its time less its largest late step, both
    # what it is named for and what it adds to the others' noise
    beyond = {r: lost[r] - max((m for _, m, _, _ in late[r]), default=0.0) for r in ranks}
    material = max(MIN_LOST_MS, MIN_LOST_SHARE * window_ms)
    # a rank late in a pattern (its late steps are not chance, or far larger than the others'
    # margins) is a straggler of its own, not jitter: it is left out of the other ranks' noise,
    # and its late steps out of the chance the others are judged against (a step has one latest
    # rank: where one straggler holds most steps, another's late steps are few among all of
    # them, many among the rest). So two stragglers in one world (slow data on one rank, a
    # periodic stall on another) do not hide each other. Only ranks whose time is material are
    # tested (they are few), once per straggler found
    patterned: set[int] = set()
    while True:
        pool = [r for r in ranks if r not in patterned]
        events = sum(len(late[r]) for r in pool)
        found = {
            r
            for r in pool
            if len(late[r]) >= MIN_LATE_STEPS and beyond[r] >= material and _not_chance(r, late, pool, events, floor)
        }
        if not found:
            break
        patterned |= found
    ordered = sorted(beyond[r] for r in ranks if r not in patterned)  # the noise, per rank in O(ranks)
    out: dict[int, RankBlame] = {}
    for r in ranks:
        noise = _median_without(ordered, beyond[r]) if r not in patterned else (median(ordered) if ordered else 0.0)
        rank_margins = [m for _, m, _, _ in late[r]]
        named = len(ranks) >= 2 and r in patterned and beyond[r] - noise >= material and beyond[r] >= DOMINANCE * noise
        out[r] = RankBlame(
            rank=r,
            lost_ms=lost[r],
            late_steps=tuple(s for s, _, _, _ in late[r]),
            margins_ms=tuple(rank_margins),
            worst=tuple(w for _, _, w, _ in late[r]),
            others_waited_ms=sum(w for _, _, _, w in late[r]),
            noise_ms=noise,
            named=named,
        )
    return Blame(steps=window, step_ms=step_ms, window_ms=window_ms, floor_ms=floor, ranks=out)


@dataclass(frozen=True)
class Pattern:
    """When a rank was late: ``kind`` is "every step", "periodic" (every ``every`` steps), "one
    period" (from ``first`` to ``last``, late in most steps between) or "intermittent"."""

    kind: str
    first: int
    last: int
    every: int | None = None

    def describe(self, late: int, steps: int) -> str:
        """Words for the finding: ``late`` steps of the ``steps`` looked at."""
        if self.kind == "every step":
            return f"every step ({late} of {steps})"
        if self.kind == "periodic":
            return f"periodically, every {self.every} steps ({late} of {steps} steps, {self.first} to {self.last})"
        if self.kind == "one period":
            return f"in steps {self.first} to {self.last} ({late} of {steps} steps)"
        return f"intermittently ({late} of {steps} steps, {self.first} to {self.last})"


def pattern(rb: RankBlame, window: Sequence[int]) -> Pattern:
    """The pattern of ``rb``'s late steps within ``window`` (the steps looked at, in order).

    Small late steps between the big ones (a straggler's own jitter) do not hide a period: the
    period is read from the steps whose margin is at least half the median margin."""
    steps = list(rb.late_steps)
    if not steps:
        return Pattern("intermittent", 0, 0)
    first, last = steps[0], steps[-1]
    if len(steps) >= EVERY_STEP_SHARE * len(window):
        return Pattern("every step", first, last)
    cut = median(rb.margins_ms) / 2
    main = [s for s, m in zip(steps, rb.margins_ms, strict=True) if m >= cut]
    inside = [s for s in window if main[0] <= s <= main[-1]]
    if len(main) >= 2 and len(main) >= EVERY_STEP_SHARE * len(inside):
        return Pattern("one period", main[0], main[-1])
    if len(main) >= 3:
        diffs = [b - a for a, b in zip(main, main[1:], strict=False)]
        every, count = Counter(diffs).most_common(1)[0]
        if every >= 2 and count >= PERIOD_SHARE * len(diffs):
            return Pattern("periodic", main[0], main[-1], every)
    return Pattern("intermittent", first, last)


# -- out of line: which ranks (and hosts) every view leads with ----------------------------------

#: The per-rank numbers (ms) judged against the other ranks, with their words. Only the ones where
#: more is worse for the rank itself: the time a rank spends waiting in collectives is what the
#: others cost it, not what it costs them.
JUDGED: tuple[tuple[str, str], ...] = (
    ("late", "late"),
    ("step", "step"),
    ("forward", "forward"),
    ("backward", "backward"),
    ("optimizer", "optimizer"),
    ("rest", "rest"),
)
#: Rank statuses out of line by themselves, with their weight in "worst first" (higher: first).
STATUS_WEIGHT: dict[str, int] = {"lost": 4, "failed": 4, "hung": 4, "stalled": 3, "terminated": 2}
#: A rank that stopped this many steps (or this share of the steps) before the others ended early.
EARLY_STEPS = 2
EARLY_SHARE = 0.01


@dataclass(frozen=True)
class Outlier:
    """One rank (or host) out of line with the others: why, and by how much.

    ``excess_ms``: per judged number, how far above the others' median it is; ``base_ms``: that
    median. ``cost_ms``: what it cost the others (the blame), ``status``: a status out of line
    by itself, ``ended``: the step it ended at while the others went on to ``of``."""

    key: int | str
    excess_ms: dict[str, float]
    base_ms: dict[str, float]
    cost_ms: float = 0.0
    named: bool = False
    status: str | None = None
    ended: int | None = None
    of: int | None = None

    def order(self) -> tuple[float, ...]:
        """Sort key, worst first: a dead or hung rank, then what it cost the others, then excess."""
        return (
            -float(STATUS_WEIGHT.get(self.status or "", 0)),
            -float(self.named),
            -self.cost_ms,
            -max(self.excess_ms.values(), default=0.0),
        )

    def reasons(self) -> list[str]:
        """Why, in a few words each: "lost", "cost the others 1.2 s", "backward +30.1 ms (50.4)"."""
        out: list[str] = []
        if self.status is not None:
            out.append(self.status)
        if self.ended is not None:
            out.append(f"logged {self.ended} of {self.of} steps")
        if self.named or self.cost_ms > 0.0:
            cost = f"{self.cost_ms / 1000.0:.2f} s" if self.cost_ms >= 1000.0 else f"{self.cost_ms:.0f} ms"
            out.append(f"cost the others {cost}")
        for name, words in JUDGED:
            if name in self.excess_ms:
                out.append(f"{words} +{self.excess_ms[name]:.1f} ms (others {self.base_ms[name]:.1f})")
        return out


def spread_floor_ms(values: Sequence[float], step_ms: float) -> float:
    """How far above the others' median a number must be to be out of line: the blame's noise
    floor (``NOISE_FLOOR_MS``, ``NOISE_FLOOR_SHARE`` of the median step) or ``JITTER_MADS``
    median absolute deviations of the ranks' values, whichever is larger."""
    mad = 0.0
    if len(values) >= 3:
        middle = median(values)
        mad = median(abs(v - middle) for v in values)
    return max(NOISE_FLOOR_MS, NOISE_FLOOR_SHARE * step_ms, JITTER_MADS * mad)


def out_of_line(
    values: Mapping[Any, Mapping[str, float | None]],
    *,
    cost_ms: Mapping[int, float | None] | None = None,
    named: set[int] | None = None,
    statuses: Mapping[int, str] | None = None,
    steps: Mapping[int, int | None] | None = None,
) -> list[Outlier]:
    """The ranks (or hosts: ``values`` keyed by host) out of line with the others, worst first.

    ``values``: per rank its numbers in ms (``JUDGED`` names; others ignored). A number is out of
    line when it is above the median of the *other* ranks' by more than ``spread_floor_ms`` (the
    step is the median of the ranks' "step"). ``named``: the ranks the blame names (their cost is
    material, not jitter), with ``cost_ms`` what each cost the others; ``statuses``: a rank
    lost, failed, hung, stalled or terminated is out of line by that alone; ``steps``: a rank that
    logged ``EARLY_STEPS`` (or ``EARLY_SHARE``) fewer steps than the most ended early. The report,
    its text, Markdown and HTML, and the live view all judge with this one function."""
    keys = list(values)
    steps_ms = [v for k in keys if (v := values[k].get("step")) is not None]
    step_ms = median(steps_ms) if steps_ms else 0.0
    excess: dict[int | str, dict[str, float]] = {k: {} for k in keys}
    base: dict[int | str, dict[str, float]] = {k: {} for k in keys}
    if len(keys) >= 2:
        for name, _ in JUDGED:
            have = {k: v for k in keys if (v := values[k].get(name)) is not None}
            if len(have) < 2:
                continue
            ordered = sorted(have.values())
            floor = spread_floor_ms(ordered, step_ms)
            middle = median(ordered)
            for k, v in have.items():
                if v - middle <= floor:
                    continue  # cheap: most ranks are near the median of them all
                others = _median_without(ordered, v)
                if v - others > floor:
                    excess[k][name] = v - others
                    base[k][name] = others
    top = max((n for n in (steps or {}).values() if n is not None), default=0)
    early = top - max(EARLY_STEPS, EARLY_SHARE * top)
    out: list[Outlier] = []
    for k in keys:
        rank = k if isinstance(k, int) else -1
        status = (statuses or {}).get(rank)
        status = status if status in STATUS_WEIGHT else None
        n = (steps or {}).get(rank)
        ended = n if n is not None and n < early else None
        is_named = rank in (named or set())
        cost = (cost_ms or {}).get(rank) or 0.0
        if excess[k] or status or ended is not None or is_named:
            out.append(
                Outlier(
                    key=k,
                    excess_ms=excess[k],
                    base_ms=base[k],
                    cost_ms=cost,
                    named=is_named,
                    status=status,
                    ended=ended,
                    of=top if ended is not None else None,
                )
            )
    out.sort(key=lambda o: (*o.order(), str(o.key)))
    return out


def by_host(
    values: Mapping[int, Mapping[str, float | None]], hosts: Mapping[int, str]
) -> dict[str, dict[str, float | None]]:
    """Per host, the median over its ranks of each judged number (what ``out_of_line`` judges
    hosts on: a slow node is one host out of line, however many ranks it holds)."""
    members: dict[str, list[int]] = {}
    for rank, host in hosts.items():
        if rank in values:
            members.setdefault(host, []).append(rank)
    out: dict[str, dict[str, float | None]] = {}
    for host, ranks in members.items():
        row: dict[str, float | None] = {}
        for name, _ in JUDGED:
            have = [v for r in ranks if (v := values[r].get(name)) is not None]
            row[name] = median(have) if have else None
        out[host] = row
    return out


def fold_into_hosts(ranks: Sequence[Outlier], hosts_out: Sequence[Outlier], hosts: Mapping[int, str]) -> list[Outlier]:
    """The ranks still to list one by one once the hosts out of line are: a rank out of line only
    in numbers its host is out of line in too (a slow node's ranks) is that host's line."""
    judged = {o.key: set(o.excess_ms) for o in hosts_out}
    return [
        o
        for o in ranks
        if not (
            isinstance(o.key, int)
            and hosts.get(o.key) in judged
            and o.status is None
            and o.ended is None
            and not o.named
            and set(o.excess_ms) <= judged[hosts[o.key]]
        )
    ]
