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
    decode,
)

#: Bare steps (without any bucket) remembered per rank: enough to name a skipped backward.
MAX_BARE_STEPS = 1000
#: Steps always kept at the end of a sampled rank log (what happened last: lost ranks, hangs).
TAIL_STEPS = 128


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
    steps_total: int = 0  # step records in the file (``steps`` holds them all unless sampled)
    step_stride: int = 1  # ``steps`` keeps every step whose index is a multiple of this, and the last ones
    bare_steps: list[int] = field(default_factory=list)  # steps logged without any bucket (first 1000)
    stream_dropped: int = 0  # records the live stream lost (this file has them): the latest total

    def add(self, record: Record) -> None:
        if isinstance(record, Step):
            self.steps.append(record)
            self.steps_total += 1
            if not record.b_ready_us and len(self.bare_steps) < MAX_BARE_STEPS:
                self.bare_steps.append(record.step)
        elif isinstance(record, ProcSample):
            self.procs.append(record)
        elif isinstance(record, Layout):
            self.layouts.append(record)
        elif isinstance(record, Header):
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

    def segments(self) -> list[tuple[Header, int, int | None]]:
        """(header, first step, first step of the next header or None) for each DDP instance seen."""
        out = []
        for i, h in enumerate(self.headers):
            nxt = self.headers[i + 1].first_step if i + 1 < len(self.headers) else None
            out.append((h, h.first_step, nxt))
        return out


class RankFileTail:
    """Incremental reader: each ``poll()`` decodes the complete lines appended since the last.

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
        if record is not None:
            if self.keep:
                self.log.add(record)
            out.append(record)


def decode_counted(line: bytes, log: RankLog) -> Record | None:
    """One line's record, or None for a blank, corrupt or unknown line (counted in ``log``)."""
    if not line.strip():
        return None
    try:
        return decode(line)
    except CorruptLine:
        log.corrupt_lines += 1
    except UnknownRecord:
        log.unknown_lines += 1
    return None


class _Peek(msgspec.Struct):
    """The few fields needed to choose which lines to decode in full."""

    kind: str = ""
    step: int | None = None
    b_ready_us: msgspec.Raw = msgspec.Raw(b"")  # left undecoded: only whether it is there


_peek_lines = msgspec.json.Decoder(_Peek).decode_lines
_peek_one = msgspec.json.Decoder(_Peek).decode


def _peek_all(lines: list[bytes], data: bytes) -> list[_Peek | None]:
    try:
        peeks: list[_Peek | None] = list(_peek_lines(data))  # one C pass over the file: the common case
        if len(peeks) == len(lines):
            return peeks
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    return [_safe_peek(line) for line in lines]  # a bad line peeks as None: decoded (and counted) in full


def read_sampled(path: Path, rank: int, ddp: int, max_steps: int) -> RankLog:
    """One rank file with at most about ``max_steps`` step records kept (plus the last ones).

    Every record that is not a step is kept. Steps are kept at a power-of-two stride of their
    index, so ranks with similar step counts keep the same steps and stay comparable step by
    step; ``steps_total`` and ``bare_steps`` still count every step in the file.
    """
    log = RankLog(rank=rank, ddp=ddp, path=path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return log
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        if data[cut:].strip():
            log.torn_tail = True
            log.corrupt_lines += 1
        data = data[:cut]
    lines = [line for line in data.split(b"\n") if line.strip()]
    peeks = _peek_all(lines, data)
    step_rows = [i for i, p in enumerate(peeks) if p is not None and p.kind == "step" and p.step is not None]
    stride = 1
    while len(step_rows) > stride * max_steps:
        stride *= 2
    tail = set(step_rows[-TAIL_STEPS:])
    keep = [
        i
        for i, p in enumerate(peeks)
        if p is None or p.kind != "step" or p.step is None or p.step % stride == 0 or i in tail
    ]
    for i in keep:
        record = decode_counted(lines[i], log)
        if record is not None:
            log.add(record)
    log.steps_total = len(step_rows)
    log.step_stride = stride
    log.bare_steps = [
        p.step for i in step_rows if (p := peeks[i]) is not None and len(p.b_ready_us) == 0 and p.step is not None
    ][:MAX_BARE_STEPS]
    return log


def _safe_peek(line: bytes) -> _Peek | None:
    try:
        return _peek_one(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
