"""Running evidence for the per-rank detectors: small accumulators fed one record at a time.

A rank that trains for a million steps must not keep its sampled records to re-read them at
each check. Each accumulator here holds what its detector needs, in space bounded by the model
(its parameters and buffers), not by the run: ``add`` takes one record, the detector reads the
accumulator. The live checks (``runtime.checks.live_findings``) feed them as records are emitted; the
report (``diagnose``) feeds them from a loaded log, so both sides apply one rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from statistics import median

from ddpdoctor.events import Fingerprint, GradFlags, Header, Unused

#: Sampled post-forward timings kept for their median (the most recent ones).
POST_FORWARD_WINDOW = 256


class NameEvidence:
    """Names listed by step-stamped records, in first-seen order, and the first step any of them
    appeared at (what ``sizes.first_seen`` computes over a list, kept as it goes)."""

    __slots__ = ("names", "first", "_known")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.first: int | None = None
        self._known: set[str] = set()

    def add(self, names: Iterable[str], step: int) -> None:
        for name in names:
            if name not in self._known:
                self._known.add(name)
                self.names.append(name)
                self.first = step if self.first is None else min(self.first, step)


class FlagEvidence:
    """``grad_flags`` records of one DDP instance: which reduced parameters were frozen, which
    were unfrozen, which were replaced or added after DDP was built, and since when."""

    __slots__ = ("frozen", "unfrozen", "any_frozen", "replaced", "added")

    def __init__(self) -> None:
        self.frozen = NameEvidence()
        self.unfrozen = NameEvidence()
        self.any_frozen = False  # some record listed a frozen parameter
        self.replaced = NameEvidence()  # a tensor DDP does not hold trains under a name it reduces
        self.added = NameEvidence()  # a parameter DDP never knew trains

    def add(self, record: GradFlags) -> None:
        self.frozen.add(record.frozen, record.step)
        self.unfrozen.add(record.unfrozen, record.step)
        self.any_frozen = self.any_frozen or bool(record.frozen)
        self.replaced.add(record.replaced, record.step)
        self.added.add(record.added, record.step)

    @classmethod
    def of(cls, records: Iterable[GradFlags]) -> FlagEvidence:
        evidence = cls()
        for r in records:
            evidence.add(r)
        return evidence


class UnusedEvidence:
    """Sampled unused-parameter checks of one DDP instance."""

    __slots__ = (
        "samples",
        "first_step",
        "unused",
        "_always",
        "post_forward_us",
        "steps_read",
        "steps_with_unused",
        "used_between",
    )

    def __init__(self) -> None:
        self.samples = 0
        # DDP's map of used parameters, read at every step (find_unused_parameters on CPU): the
        # steps read, those with a parameter no rank used
        self.steps_read = 0
        self.steps_with_unused = 0
        self.used_between: set[str] = set()  # unused at a sample, used on a step between samples
        self.first_step: int | None = None  # step of the first sample
        self.unused = NameEvidence()  # parameters without a gradient in some sample
        self._always: set[str] | None = None  # ... in every sample so far
        self.post_forward_us: deque[float] = deque(maxlen=POST_FORWARD_WINDOW)

    def add(self, record: Unused) -> None:
        self.samples += 1
        if self.first_step is None:
            self.first_step = record.step
        self.unused.add(record.names, record.step)
        names = set(record.names)
        self._always = names if self._always is None else self._always & names
        if record.post_forward_us is not None:
            self.post_forward_us.append(record.post_forward_us)
        self.steps_read += record.steps_read
        self.steps_with_unused += record.steps_with_unused
        self.used_between.update(record.used_between)

    def never_used(self) -> list[str]:
        """Parameters without a gradient in every sample (and, where DDP's map was read at every
        step, on no step between them: none where a step used every parameter), in first-seen
        order."""
        if self.steps_with_unused < self.steps_read:
            return []
        always = (self._always or set()) - self.used_between
        return [n for n in self.unused.names if n in always]

    def post_forward_median_us(self) -> float | None:
        return median(self.post_forward_us) if self.post_forward_us else None

    @classmethod
    def of(cls, records: Iterable[Unused]) -> UnusedEvidence:
        evidence = cls()
        for r in records:
            evidence.add(r)
        return evidence


class BufferEvidence:
    """Fingerprints of one DDP instance, as far as constant buffers go: per buffer, whether its
    version and values stayed what they were since DDP was attached."""

    __slots__ = ("header", "first_step", "last_step", "last_complete", "usable", "_reference", "_constant")

    def __init__(self, header: Header) -> None:
        self.header = header
        self.first_step: int | None = None  # step of the first fingerprint
        self.last_step: int | None = None  # ... and of the latest
        self.last_complete = False  # the latest listed a version for every buffer of the header
        self.usable = 0  # fingerprints with versions and values for every buffer
        self._reference: list[tuple[float | None, float | None, int]] = []  # values in the first usable fingerprint
        self._constant: list[bool] = []  # per buffer: unchanged in every usable fingerprint

    def add(self, record: Fingerprint) -> None:
        buffers = self.header.buffers
        n = len(buffers)
        if self.first_step is None:
            self.first_step = record.step
        self.last_step = record.step
        self.last_complete = len(record.buffer_versions) == n
        if not len(record.buffer_versions) == len(record.buffer_norms) == len(record.buffer_sums) == n:
            return
        self.usable += 1
        # (with the exact bits where the log has them: a change below the float sums' resolution too)
        bits = record.buffer_bits if len(record.buffer_bits) == n else [0] * n
        values = list(zip(record.buffer_norms, record.buffer_sums, bits, strict=False))
        if not self._reference:
            self._reference = values
            self._constant = [True] * n
        # The version counter is the cheap signal, but kernels that update buffers internally
        # (BatchNorm's running statistics) do not bump it: the values must not have moved either.
        for i in range(n):
            if self._constant[i] and (
                record.buffer_versions[i] != buffers[i].version or values[i] != self._reference[i]
            ):
                self._constant[i] = False

    def constant(self) -> list[int]:
        """Indexes of broadcast buffers unchanged in every usable fingerprint (needs two)."""
        if self.usable < 2:
            return []
        return [i for i, b in enumerate(self.header.buffers) if b.broadcast and self._constant[i]]

    @classmethod
    def of(cls, header: Header, records: Iterable[Fingerprint]) -> BufferEvidence:
        evidence = cls(header)
        for r in records:
            evidence.add(r)
        return evidence
