"""Reading one rank's log file, in one go or incrementally while it grows."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ddpdoctor.events import (
    CorruptLine,
    End,
    FindingRecord,
    Fingerprint,
    GradFlags,
    Hang,
    Header,
    Layout,
    ProbeOff,
    ProcSample,
    Record,
    Step,
    StreamDrops,
    UnknownRecord,
    Unused,
    Window,
    decode,
)
from ddpdoctor.events.line_index import INDEX_PREFIX
from ddpdoctor.events.schedule import DEFAULT_EVERY
from ddpdoctor.runlog.indexed import FileLines, IndexMismatch, file_lines, scanned
from ddpdoctor.runlog.windows import window_steps

#: Bare steps (without any bucket) remembered per rank: enough to name a skipped backward.
MAX_BARE_STEPS = 1000
#: Full step records (the per-bucket detail) a sampled read of a compact log keeps per rank at most,
#: however long the run: what the analysis costs then stays that of a run of about 20,000 steps.
MAX_DETAIL = 256
#: Steps always kept at the end of a sampled rank log (what happened last: lost ranks, hangs).
TAIL_STEPS = 128
#: How far back a full step record may find the window row it replaces (the writer's ring and a window).
_REPLACE_SCAN = 1024


@dataclass
class RankLog:
    """Everything one rank (one DDP model of it) logged, in file order."""

    rank: int
    ddp: int
    path: Path
    header: Header | None = None  # the first header; ``headers`` has later ones (after a rewrap)
    headers: list[Header] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    grad_flags: list[GradFlags] = field(default_factory=list)
    fingerprints: list[Fingerprint] = field(default_factory=list)
    unused: list[Unused] = field(default_factory=list)
    findings: list[FindingRecord] = field(default_factory=list)
    layouts: list[Layout] = field(default_factory=list)
    procs: list[ProcSample] = field(default_factory=list)
    probes_off: list[ProbeOff] = field(default_factory=list)
    hangs: list[Hang] = field(default_factory=list)  # watchdog records, stalled and resumed
    end: End | None = None
    corrupt_lines: int = 0  # not JSON: garbage, or a line torn by a crash
    unknown_lines: int = 0  # JSON, but not a record this version knows
    torn_tail: bool = False  # the file ends in the middle of a line
    steps_total: int = 0  # steps in the file (``steps`` holds them all unless sampled)
    step_stride: int = 1  # ``steps`` keeps every step whose index is a multiple of this, and the last ones
    bare_steps: list[int] = field(default_factory=list)  # steps logged without any bucket (first 1000)
    stream_dropped: int = 0  # records the live stream lost (this file has them): the latest total
    windows: int = 0  # window records read (a compact log: most steps are window rows, ``Step.summary``)
    full_steps: int = 0  # full step records read
    #: processes that wrote this file before the one read (a run dir reused by jobs launched one
    #: after another: each rank's file holds each job's process in turn, steps from 0 in each)
    earlier_jobs: int = 0

    def add(self, record: Record) -> None:
        if isinstance(record, Step):
            self.full_steps += 1
            self._add_step(record)
        elif isinstance(record, Window):
            self.windows += 1
            for s in window_steps(record):
                self._add_step(s)
        elif isinstance(record, ProcSample):
            self.procs.append(record)
        elif isinstance(record, Layout):
            self.layouts.append(record)
        elif isinstance(record, Header):
            if self.headers and record.pid != self.headers[-1].pid:
                self._next_job()
            if self.header is None:
                self.header = record
            self.headers.append(record)
        elif isinstance(record, Fingerprint):
            self.fingerprints.append(record)
        elif isinstance(record, GradFlags):
            self.grad_flags.append(record)
        elif isinstance(record, Unused):
            self.unused.append(record)
        elif isinstance(record, FindingRecord):
            self.findings.append(record)
        elif isinstance(record, End):
            self.end = record
        elif isinstance(record, ProbeOff):
            self.probes_off.append(record)
        elif isinstance(record, Hang):
            self.hangs.append(record)
        elif isinstance(record, StreamDrops):
            self.stream_dropped = max(self.stream_dropped, record.dropped)

    def _next_job(self) -> None:
        """Another process's header: a later job wrote on after the one read so far (within one
        process a new header is a rewrap, the same job). What the earlier job logged is dropped:
        its steps are numbered from 0 as the new job's are, and mixing them would compare
        unrelated steps. The file-level counts (corrupt lines, a torn tail) stay."""
        kept = (self.corrupt_lines, self.unknown_lines, self.torn_tail, self.earlier_jobs + 1)
        fresh = RankLog(rank=self.rank, ddp=self.ddp, path=self.path)
        self.__dict__.update(fresh.__dict__)
        self.corrupt_lines, self.unknown_lines, self.torn_tail, self.earlier_jobs = kept

    def _add_step(self, s: Step) -> None:
        steps = self.steps
        if self.windows and steps and s.step <= steps[-1].step:
            # a compact log writes a step in full after its window row when something happened
            # right after it: the full record wins, wherever the row is
            for i in range(len(steps) - 1, max(-1, len(steps) - 1 - _REPLACE_SCAN), -1):
                if steps[i].step == s.step:
                    if steps[i].summary and not s.summary:
                        steps[i] = s
                    return
                if steps[i].step < s.step:
                    break
        steps.append(s)
        self.steps_total += 1
        if is_bare(s) and len(self.bare_steps) < MAX_BARE_STEPS:
            self.bare_steps.append(s.step)

    def segments(self) -> list[tuple[Header, int, int | None]]:
        """(header, first step, first step of the next header or None) for each DDP instance seen."""
        out = []
        for i, h in enumerate(self.headers):
            nxt = self.headers[i + 1].first_step if i + 1 < len(self.headers) else None
            out.append((h, h.first_step, nxt))
        return out


class RankFileTail:
    """Incremental reader: each ``poll()`` decodes the complete lines appended since the last.

    Window records come out as the steps of their rows (``Step.summary``), so a reader sees
    steps whichever way the writer kept them.

    A partial last line is held back until its newline arrives (``final=True`` counts it as torn
    instead). A file that shrank (truncated or replaced) is read again from the start.
    """

    def __init__(self, path: Path, rank: int, ddp: int, keep: bool = True) -> None:
        self.path = path
        self.keep = keep  # add records to ``self.log`` (False: a live reader keeps its own state)
        self.log = RankLog(rank=rank, ddp=ddp, path=path)
        self._offset = 0
        self._partial = b""
        self._inode: int | None = None

    def poll(self, final: bool = False, max_bytes: int | None = None) -> list[Record]:
        """New records since the last call (also added to ``self.log`` when ``keep``).

        ``max_bytes`` bounds what one call reads (a live view catching up on a long file stays
        responsive); None reads to the end.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if st.st_size < self._offset or (self._inode is not None and st.st_ino != self._inode):
            self._offset, self._partial = 0, b""
        self._inode = st.st_ino
        out: list[Record] = []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            while True:
                chunk = f.read(max_bytes if max_bytes is not None else 64 << 20)
                if not chunk:
                    break
                self._offset += len(chunk)
                data = self._partial + chunk
                lines = data.split(b"\n")
                self._partial = lines.pop()
                for line in lines:
                    self._decode(line, out)
                if max_bytes is not None:
                    break
        if final and self._partial:
            self.log.torn_tail = True
            self.log.corrupt_lines += 1
            self._partial = b""
        return out

    def _decode(self, line: bytes, out: list[Record]) -> None:
        record = decode_counted(line, self.log)
        if record is None:
            return
        if isinstance(record, Window):  # what a reader gets is steps, whichever way they were written
            steps = window_steps(record)
            if self.keep:
                self.log.windows += 1
                for s in steps:
                    self.log._add_step(s)
            out.extend(steps)
            return
        if self.keep:
            self.log.add(record)
        out.append(record)


def decode_counted(line: bytes, log: RankLog) -> Record | None:
    """One line's record, or None for a blank, corrupt or unknown line (counted in ``log``), or
    the file's own index line (not a record: skipped)."""
    if not line.strip() or line.startswith(INDEX_PREFIX):
        return None
    try:
        return decode(line)
    except CorruptLine:
        log.corrupt_lines += 1
    except UnknownRecord:
        log.unknown_lines += 1
    return None


def is_bare(s: Step) -> bool:
    """A step logged without any bucket (its backward never reached DDP)."""
    return s.b_count == 0 if s.summary else not s.b_ready_us


#: Periodic records a sampled read keeps per rank (the first and last ``_ENDS``, evenly in between):
#: process samples, fingerprints, unused-parameter checks, by the start of their kind.
MAX_PROCS = 512
MAX_CHECKS = 128
_PERIODIC = {b'proc"': MAX_PROCS, b"finge": MAX_CHECKS, b"unuse": MAX_CHECKS}
_ENDS = 8


def _thin(rows: list[int], budget: int) -> list[int]:
    """At most about ``budget`` of ``rows``: the first and last ``_ENDS``, a power-of-two stride between.

    The records come at the same steps on every rank, so ranks keep the same ones.
    """
    if len(rows) <= budget:
        return rows
    stride = _power_of_two_stride(len(rows), budget)
    return [row for k, row in enumerate(rows) if k % stride == 0 or k < _ENDS or k >= len(rows) - _ENDS]


_records_of = msgspec.json.Decoder(list[Record]).decode


def _power_of_two_stride(count: int, budget: int) -> int:
    stride = 1
    while count > stride * budget:
        stride *= 2
    return stride


def _lines_by_kind(lines: list[bytes]) -> dict[bytes, list[int]]:
    """Line indices by the start of their kind (``{"kind":"`` is 9 bytes): one cheap pass, no decoding."""
    return _by_tag([line[9:14] for line in lines])


def _by_tag(tags: list[bytes]) -> dict[bytes, list[int]]:
    by_kind: dict[bytes, list[int]] = {}
    for i, tag in enumerate(tags):
        got = by_kind.get(tag)
        if got is None:
            by_kind[tag] = [i]
        else:
            got.append(i)
    return by_kind


def _file_lines(path: Path, log: RankLog) -> list[bytes]:
    """A rank file's complete lines (a torn last line counted in ``log``); none when it is missing."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        if data[cut:].strip():
            log.torn_tail = True
            log.corrupt_lines += 1
        data = data[:cut]
    return data.split(b"\n")


def job_spans(path: Path, rank: int, ddp: int) -> list[tuple[int | None, int | None]]:
    """(start, end) on the wall clock (ns) of each process that wrote the file, in order (the
    indices ``read_job`` takes): its first header (None: none readable), and its End record (None:
    it has none, it crashed or runs on). Decodes only those lines."""
    log = RankLog(rank=rank, ddp=ddp, path=path)
    lines = _file_lines(path, log)
    by_kind = _lines_by_kind(lines)
    headers, ends = by_kind.get(b"heade", []), by_kind.get(b'end",', [])
    cuts = job_cuts(lines, headers, log)
    spans: list[tuple[int | None, int | None]] = []
    for k, first in enumerate(cuts):
        stop = cuts[k + 1] if k + 1 < len(cuts) else len(lines)
        start = _wall_ns(lines, [i for i in headers if first <= i < stop], log)
        end = _wall_ns(lines, [i for i in reversed(ends) if first <= i < stop], log)
        spans.append((start, end))
    return spans


def _wall_ns(lines: list[bytes], at: list[int], log: RankLog) -> int | None:
    """The wall time of the first header or End record among lines ``at``."""
    for i in at:
        record = decode_counted(lines[i], log)
        if isinstance(record, (Header, End)):
            return record.t_wall_ns
    return None


def read_job(path: Path, rank: int, ddp: int, segment: int) -> RankLog:
    """Every record of the ``segment``-th process (0 first) that wrote the file, as ``RankFileTail``
    reads a whole file (a run dir that several jobs wrote one after another: ``load_run(job=K)``)."""
    tail = RankFileTail(path, rank, ddp)
    lines = _file_lines(path, tail.log)
    cuts = job_cuts(lines, _lines_by_kind(lines).get(b"heade", []), tail.log)
    if segment < len(cuts):
        stop = cuts[segment + 1] if segment + 1 < len(cuts) else len(lines)
        for line in lines[cuts[segment] : stop]:
            tail._decode(line, [])
    tail.log.earlier_jobs = segment
    return tail.log


def job_cuts(lines: list[bytes] | FileLines, at: list[int], log: RankLog) -> list[int]:
    """The first line of each process that wrote the file (0 first), from the header lines ``at``:
    a header whose process differs from the header before it starts a later job
    (``RankLog._next_job``). Only the header lines are decoded."""
    cuts, pid = [0], None
    if len(at) < 2:
        return cuts
    for i in at:
        record = decode_counted(lines[i], RankLog(rank=log.rank, ddp=log.ddp, path=log.path))  # (counted once, later)
        if isinstance(record, Header):
            if pid is not None and record.pid != pid:
                cuts.append(i)
            pid = record.pid
    return cuts


def _decode_many(lines: list[bytes], log: RankLog) -> list[Record]:
    """Lines decoded in one C pass (one bad line: each line on its own, bad ones counted)."""
    if not lines:
        return []
    try:
        return _records_of(b"[" + b",".join(lines) + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError):
        out = []
        for line in lines:
            record = decode_counted(line, log)
            if record is not None:
                out.append(record)
        return out


def read_sampled(path: Path, rank: int, ddp: int, max_steps: int, segment: int | None = None) -> RankLog:
    """One rank file with at most about ``max_steps`` steps decoded, whatever the file's length.

    Steps are kept at a power-of-two stride of their index, so ranks with similar step counts keep
    the same steps and stay comparable step by step, plus the last ``TAIL_STEPS``. A compact log
    (windows) gives half of ``max_steps`` to the stride and a quarter (at most ``MAX_DETAIL``) to its
    full step records, the per-bucket detail: all of them when they fit, else the first and last ones
    outside the sampled schedule (what happened) and the sampled ones at a stride. Only the lines that hold a kept
    step are decoded: the others are told apart by the head of the line, so the cost grows with
    ``max_steps``, not with the file. ``steps_total`` and ``bare_steps`` still count every step.
    Every record that is not a step is kept, but the periodic ones are thinned the same way
    (``MAX_PROCS`` process samples, ``MAX_CHECKS`` fingerprints and unused-parameter checks).

    A file that several jobs' processes wrote one after another is read from its last process on
    (``earlier_jobs`` counts the others), or at its ``segment``-th process (0 first) when given.

    Where the file carries its own line index (``sinks.line_index``), the kinds and steps of its
    lines come from the index and only the lines kept are read: the file is never scanned whole.
    """
    try:
        found = file_lines(path)
        if found is not None:
            return _read_sampled(found[0], found[1], path, rank, ddp, max_steps, segment)
    except (IndexMismatch, OSError, ValueError):
        pass  # an index that does not match the file: read it all, as before the index
    log = RankLog(rank=rank, ddp=ddp, path=path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return log
    lines, torn = scanned(path, data)
    return _read_sampled(lines, torn, path, rank, ddp, max_steps, segment)


def _read_sampled(
    lines: FileLines, torn: bool, path: Path, rank: int, ddp: int, max_steps: int, segment: int | None
) -> RankLog:
    log = RankLog(rank=rank, ddp=ddp, path=path)
    if torn:
        log.torn_tail = True
        log.corrupt_lines += 1
    by_kind = lines.by_kind()
    by_kind.pop(b"index", None)  # the file's own index lines (a scanned file): not records
    cuts = job_cuts(lines, by_kind.get(b"heade", []), log)
    part = len(cuts) - 1 if segment is None else segment
    if len(cuts) > 1 or part:  # (rare: a run dir that several jobs wrote) read one process's lines
        stop = cuts[part + 1] if part + 1 < len(cuts) else len(lines)
        lines = lines.slice(cuts[part], stop) if part < len(cuts) else lines.slice(0, 0)
        by_kind = lines.by_kind()
        by_kind.pop(b"index", None)
        log.earlier_jobs = part
    full: list[tuple[int, int]] = []  # (step, line)
    windows: list[tuple[int, int, int]] = []  # (first step, rows, line)
    others: list[int] = []  # every other record, and any step line not as the writer puts it
    step_lines = by_kind.pop(b'step"', []) + by_kind.pop(b"windo", [])
    for i, head in zip(step_lines, lines.heads(step_lines), strict=True):
        if head is None:
            others.append(i)
        elif head[0] == "step":
            full.append((head[1], i))
        else:
            windows.append((head[1], head[2], i))
    full.sort(key=lambda t: t[1])
    windows.sort(key=lambda t: t[2])
    # the periodic records: process samples, fingerprints, unused checks (the same steps on every rank)
    periodic = [_thin(by_kind.pop(tag, []), budget) for tag, budget in _PERIODIC.items()]
    others += [i for tag, rows in by_kind.items() for i in rows if tag or lines[i].strip()]
    # which steps the file has, and which of them are bare
    rows = sum(n for _, n, _ in windows)
    covered = _covered(windows, [s for s, _ in full]) if windows else 0
    total = rows + len(full) - covered
    last = max(max((s for s, _ in full), default=-1), max((s + n - 1 for s, n, _ in windows), default=-1))
    # a compact log shares the budget: half for the steps on the stride, half for the full records
    stride = _power_of_two_stride(total, max_steps // 2 if windows else max_steps)
    if len(windows) > max_steps // 4:
        # a long compact log: past a window's rows, each step on the stride costs a whole window
        # decoded for one row; a quarter of the budget in windows bounds that cost by the budget,
        # not by the file (a run of 160,000 steps then reads like one of 20,000)
        stride = max(stride, _power_of_two_stride(total, max(1, max_steps // 4)))
    tail_from = _tail_start(windows, full, last)
    on_stride = _OnStride(stride, tail_from)
    # full records: on the stride or in the tail; in a compact log also the ones that hold what happened
    keep_full = [i for s, i in full if s in on_stride]
    if windows:
        keep_full = sorted(set(keep_full) | set(_detail(full, min(max_steps // 4, MAX_DETAIL))))
    keep_windows = [i for s, n, i in windows if on_stride.meets(s, n)]
    chosen = sorted(others + [i for rows in periodic for i in rows] + keep_full + keep_windows)
    for record in _decode_many(lines.many(chosen), log):
        if isinstance(record, Window):
            log.windows += 1
            for s in window_steps(record, on_stride.rows(record.step, record.n)):
                log._add_step(s)
        else:
            log.add(record)
    if windows:
        _sort_steps(log)
    log.steps_total = total
    log.step_stride = stride
    log.bare_steps = _bare(lines, full, windows)
    return log


class _OnStride:
    """The step indices a sampled read keeps: multiples of ``stride``, and all from ``tail_from`` on."""

    def __init__(self, stride: int, tail_from: int) -> None:
        self.stride = stride
        self.tail_from = tail_from

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and (step % self.stride == 0 or step >= self.tail_from)

    def rows(self, first: int, n: int) -> range | list[int]:
        """The kept row indices of steps ``first`` .. ``first + n - 1``."""
        if first + n - 1 >= self.tail_from:
            tail = max(0, self.tail_from - first)
            return sorted(set(range(-first % self.stride, tail, self.stride)) | set(range(tail, n)))
        return range(-first % self.stride, n, self.stride)

    def meets(self, first: int, n: int) -> bool:
        """Whether steps ``first`` .. ``first + n - 1`` hold a kept one."""
        return first + n - 1 >= self.tail_from or (first + self.stride - 1) // self.stride * self.stride < first + n


def _covered(windows: list[tuple[int, int, int]], full: list[int]) -> int:
    """How many full steps are also a window row (written again in full after something happened)."""
    from bisect import bisect_right

    starts = sorted((s, n) for s, n, _ in windows)
    firsts = [s for s, _ in starts]
    count = 0
    for step in full:
        j = bisect_right(firsts, step) - 1
        if j >= 0 and step < starts[j][0] + starts[j][1]:
            count += 1
    return count


def _tail_start(windows: list[tuple[int, int, int]], full: list[tuple[int, int]], last: int) -> int:
    """The first of the last ``TAIL_STEPS`` step indices (steps are numbered without gaps in a segment)."""
    if not windows:
        steps = [s for s, _ in full]
        return steps[-TAIL_STEPS] if len(steps) >= TAIL_STEPS else (steps[0] if steps else 0)
    return last - TAIL_STEPS + 1


def _detail(full: list[tuple[int, int]], budget: int) -> list[int]:
    """Lines of the full step records a compact log's sampled read keeps (see ``read_sampled``)."""
    if len(full) <= budget:
        return [i for _, i in full]
    unsampled = [i for s, i in full if s % DEFAULT_EVERY]  # first steps, and around incidents
    half = budget // 2
    kept = unsampled if len(unsampled) <= half else unsampled[: half // 2] + unsampled[-(half - half // 2) :]
    sampled = [(s, i) for s, i in full if not s % DEFAULT_EVERY]
    every = DEFAULT_EVERY * _power_of_two_stride(len(sampled), budget - len(kept))
    return kept + [i for s, i in sampled if not s % every]


def _sort_steps(log: RankLog) -> None:
    """Steps in index order, one per index, a full record over a window row (sampled reads add both)."""
    best: dict[int, Step] = {}
    for s in log.steps:
        have = best.get(s.step)
        if have is None or (have.summary and not s.summary):
            best[s.step] = s
    log.steps = [best[k] for k in sorted(best)]


def _bare(lines: FileLines, full: list[tuple[int, int]], windows: list[tuple[int, int, int]]) -> list[int]:
    bare = [(s, s + 1) for s, i in full if lines.is_bare(i)]
    bare += [(s, s + n) for s, n, i in windows if lines.is_bare(i)]
    out: list[int] = []
    for a, b in sorted(bare):
        for step in range(a, b):
            if not out or step > out[-1]:
                out.append(step)
            if len(out) >= MAX_BARE_STEPS:
                return out
    return out
