"""What one rank logs: the record kinds of the per-rank JSON-lines log.

Every record is a JSON object on one line with a ``kind`` field. Times inside a step are
microseconds relative to the step's start (``t0``); absolute anchors are nanoseconds of the
rank's monotonic clock (``*_mono_ns``) and wall clock (``*_wall_ns``), so the reader can align
ranks without assuming their clocks agree.

Adding a field with a default keeps old logs readable; renaming or removing one bumps
``SCHEMA_VERSION``.

Version 2 added the ``window`` record: the file writer keeps full ``step`` records at sampled
steps and around anything anomalous, and rolls the other steps up into windows of per-step
columns (``sinks.compact``). Version 1 logs (a ``step`` record for every step) read as before.

Version 3 compares ranks by exact fingerprints: a ``fingerprint`` record carries each tensor's
bits, and a parameter's float sum is no longer written (its bits say all it said, exactly).
Version 2 logs (norms and sums only) are compared by their norms and sums, as before.
"""

from __future__ import annotations

from typing import Any

import msgspec

SCHEMA_VERSION = 3


class _Record(msgspec.Struct, tag_field="kind", omit_defaults=True, kw_only=True):
    rank: int
    ddp: int = 0  # index of the DDP model in its process: 0 unless one process wraps several


class ParamInfo(msgspec.Struct, omit_defaults=True):
    """One parameter as it was when ddpdoctor attached."""

    name: str
    shape: list[int]
    dtype: str
    numel: int
    requires_grad: bool
    ignored: bool = False  # listed in DDP's parameters_to_ignore
    reduced: bool = True  # DDP synchronizes its gradient (decided once, in DDP's constructor)


class BufferInfo(msgspec.Struct, omit_defaults=True):
    """One module buffer as it was when ddpdoctor attached."""

    name: str
    shape: list[int]
    dtype: str
    bytes: int
    broadcast: bool  # part of what DDP broadcasts from rank 0 at each forward
    version: int = 0  # the tensor's version counter: it moves on every in-place change
    checksum: float = 0.0  # sum of the values, a cheap fingerprint
    ignored: bool = False  # listed in DDP's parameters_to_ignore (which names buffers too)


class Header(_Record, tag="header", kw_only=True):
    """First line of every rank file: who wrote it and how DDP was configured."""

    # the log's schema version; writers set it (``SCHEMA_VERSION``). The default is the version of
    # logs that left it out (it equalled the default then, and defaults are not written)
    schema: int = 1
    run_id: str = ""
    world_size: int = 1
    local_rank: int = 0
    host: str = ""
    pid: int = 0
    backend: str = ""
    device: str = "cpu"
    clock: str = "host"  # "host": bucket times from host clocks; "cuda": from CUDA events
    torch: str = ""
    python: str = ""
    argv: list[str] = []
    t_mono_ns: int = 0
    t_wall_ns: int = 0
    ddp_options: dict[str, Any] = {}
    params: list[ParamInfo] = []
    buffers: list[BufferInfo] = []
    reason: str = "attach"  # "attach", or "rewrap" when ddpdoctor.rewrap rebuilt DDP mid-run
    first_step: int = 0  # index of the first step recorded under this header
    # what timed the buckets: "python" (a Python comm hook) or "native" (ddpdoctor's C++ comm hook for
    # DDP's default all-reduce; a user hook registered after instrument is then timed in Python)
    timing: str = "python"
    # the global ranks of DDP's process group where it is a subgroup of the world (data parallel
    # inside model-parallel groups: several DDP groups in one run, each all-reducing on its own);
    # empty where DDP spans the whole world. ``world_size`` is the group's size.
    group_ranks: list[int] = []
    # the whole world's size where DDP runs over a subgroup of it (0 where it spans the world, and
    # in logs written before it was logged): a live reader then knows the other groups' ranks
    # exist before their first record
    dist_world_size: int = 0

    def whole_world_size(self) -> int:
        """The ranks this header promises in the whole run: DDP's world, or the whole world where
        DDP runs over a subgroup of it (``world_size`` is then the group's size; a log without
        ``dist_world_size`` promises at least up to its group's highest rank)."""
        if not self.group_ranks:
            return self.world_size
        return max(self.dist_world_size, max(self.group_ranks) + 1)


class BucketInfo(msgspec.Struct):
    """One gradient bucket: which parameters it holds, how many bytes, which dtype."""

    index: int
    params: list[str]
    bytes: int
    dtype: str


class Layout(_Record, tag="layout", kw_only=True):
    """The bucket layout seen at ``step``: once at the start, again after DDP rebuilds it, and
    again when a comm hook is registered after ``instrument`` (the header has the one before)."""

    step: int
    reason: str  # "initial", "rebuilt", "changed", or "comm_hook" (only the hook changed)
    buckets: list[BucketInfo]
    comm_hook: str | None = None  # the user's comm hook in effect (None: DDP's default all-reduce)


class Step(_Record, tag="step", kw_only=True):
    """One synchronized training step on one rank, with per-bucket arrays.

    ``t0`` is the start of the first forward of the step (the first ``no_sync`` micro-step when
    gradients are accumulated). Durations and offsets are in microseconds from ``t0``; a field is
    absent (None) when its probe did not see the event.
    """

    step: int
    t0_mono_ns: int
    t0_wall_ns: int
    micro: int = 0  # forwards run under no_sync before this step's synchronizing forward
    fwd_start_us: float = 0.0  # start of the synchronizing forward
    fwd_us: float | None = None  # forward compute, buffer broadcast excluded
    bcast_start_us: float | None = None  # entry into the step's first buffer broadcast (a collective)
    bcast_us: float | None = None  # buffer broadcast inside that forward
    bcast_bytes: int = 0
    fwd_end_us: float | None = None
    bwd_end_us: float | None = None  # backward compute finished (autograd graph done)
    b_ready_us: list[float | None] = []  # per bucket: all its gradients ready (comm hook called)
    b_launch_us: list[float | None] = []  # per bucket: communication launched (hook returned)
    b_done_us: list[float | None] = []  # per bucket: communication completed
    b_bytes: list[int] = []
    sync_end_us: float | None = None  # last bucket completed
    opt_start_us: float | None = None  # optimizer.step() of this step, when one ran
    opt_end_us: float | None = None
    end_us: float | None = None  # start of the next step: the step's duration
    clock: str = "host"
    # Set only on steps read back from a ``window`` row (never written in a ``step`` record):
    # the per-bucket arrays are empty there, and these say what the row kept of them.
    summary: bool = False
    b_count: int = 0  # buckets whose gradients were ready (0 with ``summary``: a bare step)
    b_first_ready_us: float | None = None  # earliest bucket ready
    b_last_ready_us: float | None = None  # latest bucket ready
    b_bytes_total: int = 0

    def with_lists(self) -> Step:
        """This record with its bucket columns as lists. A record built by the native extension
        holds them as ``Column``s (read-only sequences of doubles, None where a bucket was not
        seen: one object a column, not a float object a bucket), which read as lists do and which
        ``events.codec`` encodes as lists; msgspec's own encoder, ``json`` and code that mutates a
        column want the lists (``sinks.plain_columns`` hands them to a sink that
        is not ddpdoctor's)."""
        ready, launch, done = self.b_ready_us, self.b_launch_us, self.b_done_us
        if type(ready) is list and type(launch) is list and type(done) is list:
            return self
        return msgspec.structs.replace(self, b_ready_us=list(ready), b_launch_us=list(launch), b_done_us=list(done))

    def ready_span_us(self) -> tuple[float, float] | None:
        """(earliest, latest) bucket ready, from the arrays or a window row; None without any."""
        if self.summary:
            if self.b_first_ready_us is None or self.b_last_ready_us is None:
                return None
            return self.b_first_ready_us, self.b_last_ready_us
        ready = [t for t in self.b_ready_us if t is not None]
        return (min(ready), max(ready)) if ready else None

    def per_bucket(self) -> bool:
        """Whether every bucket's ready and done times are here. Not in a window row, nor in a
        CUDA step between the sampled ones: the runtime marks its first and last bucket ready
        and DDP's wait's end (``sync_end_us``) only, and ``ready_span_us`` has what is known."""
        if self.summary:
            return False
        return not (self.b_ready_us and not self.b_done_us and self.sync_end_us is not None)

    def bucket_count(self) -> int:
        """Buckets whose gradients were ready in this step (0: a bare step, backward never reached DDP)."""
        return self.b_count if self.summary else len(self.b_ready_us)

    def bucket_bytes(self) -> int:
        """Bytes of those buckets."""
        return self.b_bytes_total if self.summary else sum(b or 0 for b in self.b_bytes)


class ProcSample(_Record, tag="proc", kw_only=True):
    """Process statistics sampled at a low rate."""

    t_mono_ns: int
    t_wall_ns: int
    cpu_pct: float
    rss_bytes: int
    dev_mem_bytes: int | None = None
    dev_max_mem_bytes: int | None = None


class ProbeOff(_Record, tag="probe_off", kw_only=True):
    """A ddpdoctor probe failed and was switched off; training went on."""

    t_wall_ns: int
    probe: str
    error: str


class End(_Record, tag="end", kw_only=True):
    """The monitor closed: the stream ended cleanly, not by a crash."""

    t_mono_ns: int
    t_wall_ns: int
    steps: int
    # "close", "exit", "signal", or "error: <exception type>" (an exception left a with-block, or
    # ended the script uncaught)
    reason: str
    # the stop signal ("SIGTERM", "SIGINT") the process caught before this end, if any: a job
    # whose own handler answers a preemption by saving and exiting ends with reason "exit" (or
    # "close") and this set; empty where no such signal came (or it could not be seen: another
    # owner of the signal wakeup fd, an event loop)
    signal: str = ""


class GradFlags(_Record, tag="grad_flags", kw_only=True):
    """requires_grad, or the parameters themselves, differ from what DDP was built with (logged
    when it changes; each list is the state as of ``step``)."""

    step: int
    frozen: list[str] = []  # reduced by DDP, requires_grad now False
    unfrozen: list[str] = []  # not reduced by DDP, requires_grad now True
    # trained under a name DDP reduces, but a tensor DDP does not hold (replaced after DDP was
    # built: DDP reduces the old tensor, orphaned, and the new one trains on each rank's own gradient)
    replaced: list[str] = []
    # trained under a name DDP never knew (a parameter or a submodule added after DDP was built)
    added: list[str] = []


class Fingerprint(_Record, tag="fingerprint", kw_only=True):
    """Cheap fingerprints of parameters and buffers, taken by every rank at the same sampled steps.

    Lists follow the header's ``params`` and ``buffers`` order: the L2 norm of each tensor, its
    bits (the sum of its elements' bit patterns as integers, folded to 53 bits: exact, so equal
    tensors give equal bits on every rank, where a float sum's last bits depend on the rank's
    thread count), each buffer's sum (compared between a rank's fingerprints) and version counter
    (in-place changes since creation, less the bumps of DDP's own buffer broadcasts, which some
    torch releases count). Ranks are compared by the bits; logs of schema 2 and before, which
    have none, by the norm and the sum (``param_sums``, no longer written).
    """

    step: int
    # (None: not finite. JSON has no NaN or infinity, and the writer puts null in their place: a
    # replica whose weights went NaN must still be read, not skipped as an unknown line)
    param_norms: list[float | None] = []
    param_sums: list[float | None] = []
    param_bits: list[int] = []
    buffer_norms: list[float | None] = []
    buffer_sums: list[float | None] = []
    buffer_bits: list[int] = []
    buffer_versions: list[int] = []
    after_broadcast: bool = False  # taken after DDP broadcast the buffers in this forward
    # taken at the end of the rank's run (close or exit), ``step`` = steps it ran: ranks with
    # uneven inputs under Join end at different steps and are compared at the run's end
    final: bool = False


class Unused(_Record, tag="unused", kw_only=True):
    """At a sampled step: DDP-reduced parameters that received no gradient."""

    step: int
    names: list[str] = []
    post_forward_us: float | None = None  # DDP's post-forward work (graph search with find_unused)
    # per parameter (header order): when its gradient was accumulated, µs from the step's start
    # on the monotonic clock (host time); None when not reduced or no gradient
    param_ready_us: list[float | None] = []
    # find_unused_parameters on a CPU model: DDP's own map of the parameters each step used, read
    # at every synchronizing step since the previous sample (``runtime/checks/used_map.py``): the steps
    # read, those of them with a parameter no rank used, and the steps whose set of such
    # parameters differed from the step before's. All 0 where it is not read.
    steps_read: int = 0
    steps_with_unused: int = 0
    unused_set_changes: int = 0
    # of ``names``, those the map saw used on some rank at some step since the previous sample
    used_between: list[str] = []


class FindingRecord(_Record, tag="finding", kw_only=True):
    """A finding raised live on this rank, as the warning said it."""

    step: int | None = None
    code: str
    severity: str
    title: str
    detail: str
    fix: str
    ranks: list[int] = []
    evidence: dict[str, Any] = {}


class Hang(_Record, tag="hang", kw_only=True):
    """The hang watchdog's view of this rank: no progress for ``waited_s`` seconds.

    ``state`` is "stalled" when the watchdog fires (flushed at once) and "resumed" when progress
    came back after a stall (a slow checkpoint, not a hang). ``phase`` is where the rank is:
    "forward", "buffer broadcast", "backward", "allreduce" (waiting for bucket
    ``pending_bucket``), "optimizer", "collective" (a ``torch.distributed`` call of the script's
    own, named in ``collective``), or "between steps" (data loading, evaluation, user code).
    """

    t_mono_ns: int
    t_wall_ns: int
    state: str = "stalled"
    step: int  # the step in progress (not finished yet)
    phase: str
    waited_s: float  # since the last progress mark
    pending_bucket: int | None = None  # first bucket whose all-reduce has not completed
    buckets: int = 0  # buckets in the layout
    buckets_ready: int = 0  # buckets whose gradients were ready (comm hook called) in this step
    buckets_done: int = 0  # buckets whose all-reduce completed in this step
    stack: list[str] = []  # the main thread's Python stack, innermost frame last
    # the torch.distributed call the stack shows the rank blocked in, where the step marks do not
    # ("barrier", "all_reduce", ...; "broadcast_coalesced": DDP's buffer broadcast in a forward
    # outside a training step); "" when none or read from the marks
    collective: str = ""


class StreamDrops(_Record, tag="stream_drops", kw_only=True):
    """Records the live stream (``--endpoint``) could not deliver; this file still has them all.

    ``dropped`` is the running total since the stream started (the receiver was slow or down, or
    a connection broke with records in flight), written at most every few seconds and at close.
    """

    t_wall_ns: int
    endpoint: str
    dropped: int


class Window(_Record, tag="window", kw_only=True):
    """Steps ``step`` .. ``step + n - 1`` of one rank, one row per step, in columns.

    What the compact log writes for steps that are neither sampled nor near anything anomalous
    (those get a full ``step`` record; a step may have both, and the full record wins). Per row:

    - ``t0``: the step's start on the monotonic clock, in µs after the previous row's (the first
      row's is 0): ``t0_mono_ns`` of row i is the window's ``t0_mono_ns`` plus 1000 times the
      running sum, exact to 1 µs;
    - ``wall``: the row's ``t0_wall_ns - t0_mono_ns`` less the window's, in µs (empty: all 0);
    - the phase columns: the ``Step`` field of the same name (``fwd_start`` is ``fwd_start_us``,
      ...), in whole µs from the row's start, null where the probe saw nothing; an empty column
      is null on every row; ``ready_first`` and ``ready_last`` are the earliest and the latest
      bucket ready;
    - ``micro``: ``Step.micro`` (empty: all 0).

    Every row of a window has the same ``buckets`` (ready count; 0: no bucket at all, a bare
    step), ``bytes`` (their sum), ``bcast_bytes`` and ``clock``.
    """

    step: int
    n: int
    t0_mono_ns: int
    t0_wall_ns: int
    buckets: int = 0
    bytes: int = 0
    bcast_bytes: int = 0
    clock: str = "host"
    t0: list[int] = []
    wall: list[int] = []
    micro: list[int] = []
    fwd_start: list[int | None] = []
    fwd: list[int | None] = []
    bcast_start: list[int | None] = []
    bcast: list[int | None] = []
    fwd_end: list[int | None] = []
    bwd_end: list[int | None] = []
    ready_first: list[int | None] = []
    ready_last: list[int | None] = []
    sync_end: list[int | None] = []
    opt_start: list[int | None] = []
    opt_end: list[int | None] = []
    end: list[int | None] = []


Record = (
    Header
    | Layout
    | Step
    | ProcSample
    | ProbeOff
    | End
    | GradFlags
    | Fingerprint
    | Unused
    | FindingRecord
    | Hang
    | StreamDrops
    | Window
)
RECORD_TYPES: tuple[type, ...] = (
    Header,
    Layout,
    Step,
    ProcSample,
    ProbeOff,
    End,
    GradFlags,
    Fingerprint,
    Unused,
    FindingRecord,
    Hang,
    StreamDrops,
    Window,
)
