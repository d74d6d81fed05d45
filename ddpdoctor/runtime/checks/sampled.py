"""The checks beside the timings: requires_grad on every forward, the rest on sampled steps.

Every training forward: ``requires_grad`` of all parameters, read in one ``map`` and compared
with what DDP was built with; a change emits a ``grad_flags`` record.

The reduction sentinel: the module's parameters now against the tensors DDP's reducer holds (by
identity). A parameter assigned after DDP was built (``ddp.module.fc.weight = nn.Parameter(w)``,
a submodule reassigned, one added) trains on each rank's own gradient, never all-reduced. torch's
global registration hooks say when any module registers a parameter or a submodule (one flag
set: the next forward walks the module once); the sampled steps walk it too (a parameter put in
``_parameters`` by hand). A change emits a ``grad_flags`` record, and the fingerprints follow the
module's current parameters by name from then on, so the replicas' drift is seen too.

Sampled steps (``schedule``: dense early, then every ``check_every``): post-accumulate-grad hooks
on the reduced parameters (which got no gradient: ``unused``, and when each was ready), a one-shot
forward pre-hook on the *wrapped* module (after DDP's buffer broadcast) that takes fingerprints
(taken at once instead where DDP has no buffers to broadcast),
and a one-shot timing of DDP's ``_post_forward`` (the graph search ``find_unused_parameters``
costs). A sample in which no parameter got a gradient (the model ran forward again before any
backward: a GAN's discriminator on real then fake data) says nothing and is dropped; the next
synchronizing forward samples instead. ``final`` takes one more fingerprint at the end of the
run, so replicas are compared at the end of a run of any length.

A fingerprint's buffer versions leave out what DDP's own buffer broadcast adds: on some torch
releases (2.5) the broadcast copies into every broadcast buffer, on every rank, and so bumps its
version counter at every forward, though nothing changed it. How much one broadcast bumps each
buffer is measured once, around the first sampled broadcast (versions read before DDP's forward
and again before the wrapped module's), and each fingerprint subtracts that times the broadcasts
counted since attach. Where the broadcast bumps nothing (2.13, 2.14) this subtracts zero.

What a check keeps is bounded: one sample in progress at a time, and the hooks it adds are
removed when it ends.
"""

from __future__ import annotations

import contextlib
import operator
import time
import weakref
from collections.abc import Callable
from typing import Any

from ddpdoctor.categories import CommHookWarning, warn
from ddpdoctor.events import Fingerprint, GradFlags, Header, Unused
from ddpdoctor.events.schedule import is_sampled, next_sampled  # shared with the file writer (sinks.compact)
from ddpdoctor.runtime import torch_compat
from ddpdoctor.runtime.checks.fingerprints import Fingerprinter
from ddpdoctor.runtime.checks.used_map import UsedMap
from ddpdoctor.runtime.step import clocks
from ddpdoctor.runtime.step.clocks import HostClock

_requires_grad = operator.attrgetter("requires_grad")
#: Walks of the model in a row, asked for by torch's registration hooks, that found no change: then
#: the hooks go (the process builds modules at every step) and the sampled steps walk it alone
IDLE_WALKS = 32
#: Synchronizing forwards in a row that sample again after a sample saw no gradient at all
#: (bounded: a DDP model run forward with grad on and never backpropagated must not be sampled
#: at every forward)
VOID_RESAMPLES = 4


class _Sample:
    """A sampled step in progress: which reduced parameters received a gradient, and when."""

    __slots__ = ("step", "seen", "t0_mono_ns", "hooked", "handles", "post_forward_us", "pre_versions", "native")

    def __init__(self, step: int, t0_mono_ns: int) -> None:
        self.step = step
        self.seen: dict[int, int] = {}  # parameter index -> monotonic ns its gradient was accumulated
        self.t0_mono_ns = t0_mono_ns
        self.hooked: list[tuple[int, str]] = []
        self.handles: list[Any] = []
        self.post_forward_us: float | None = None
        #: buffer versions before DDP's forward (only until the broadcast's own bumps are known)
        self.pre_versions: list[int] | None = None
        #: the extension's ParamSample when it stamps the arrivals (None: Python hooks do)
        self.native: Any = None


def buffer_slots(module: Any) -> list[tuple[dict[str, Any], str]]:
    """Where each of ``module``'s buffers lives, in ``named_buffers`` order (each tensor once): its
    module's ``_buffers`` and its name there. A buffer the script assigns anew
    (``module.running_mean = t``, ``register_buffer``) replaces that entry, so reading through the
    slots sees it; a module or buffer added after this call is not seen (nor does DDP broadcast it)."""
    seen: set[int] = set()
    slots = []
    for _, sub in module.named_modules():
        for name, b in sub._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                slots.append((sub._buffers, name))
    return slots


class SampledChecks:
    """The checks of one monitor on one DDP instance (a new one after ``rewrap``)."""

    def __init__(
        self,
        ddp: Any,
        header: Header,
        check_every: int,
        emit: Any,
        rank: int,
        ddp_index: int,
        same_flags: Callable[[list[Any], bytes], bool] | None = None,
        param_sample: Callable[[list[Any]], Any] | None = None,
        tensor_values: Callable[[list[Any], int], tuple[list[float], list[float], list[int]]] | None = None,
        failed: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self._ddp: Any = weakref.ref(ddp)
        self.check_every = max(1, int(check_every))
        self._emit = emit
        #: how a failure inside the hook of the checks' own (the fingerprint's, on the wrapped
        #: module) is reported: the monitor's ``probes.failed``, which switches the checks off.
        #: Everything else here runs inside the monitor's hooks, which report it alike.
        self._failed = failed
        self.rank = rank
        self.ddp_index = ddp_index
        named = list(ddp.module.named_parameters())
        # where each buffer lives, as the header listed them: a sample reads them without walking
        # every module (which cost a fingerprint a third of its time on a small MLP)
        self._buffer_slots = buffer_slots(ddp.module)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.reduced = [p.reduced for p in header.params]
        self.ignored = [p.ignored for p in header.params]
        self.flags = [p.requires_grad for p in header.params]
        #: the native extension's one-call check (``same_requires_grad(params, flag_bytes)``),
        #: when it is loaded; None: the flags are read from Python
        self.same_flags = same_flags
        #: ``flags`` as a byte per parameter, what ``same_flags`` compares with (b"": a walk is due)
        self.flag_bytes = bytes(self.flags)
        # the native extension's ParamSample, when it is loaded: a sample's per-parameter arrivals
        # stamped by C++ hooks it takes off again (Python's post-accumulate-grad hooks leave a C++
        # caller on every parameter for good, which takes the GIL at every later backward)
        self._param_sample = param_sample
        #: whether compiled autograd may trace the sampled backward (its C++ hooks must then stay
        #: off the graph); the monitor gives the native timing's own answer where it has one
        self.compiled_possible: Callable[[], bool] = torch_compat.compiled_autograd_possible
        # (flags, the reduced parameters requiring grad as (index, name), those parameters): a
        # sample's hooked parameters, made again only when the flags change (a new ``flags`` list)
        self._hooked: tuple[list[bool], list[tuple[int, str]], list[Any]] | None = None
        self.sample: _Sample | None = None
        self.bcast_in_forward = False  # set by the monitor when DDP broadcast buffers in this forward
        self.broadcasts = 0  # DDP's buffer broadcasts since attach (counted by the monitor)
        # the buffers are rank 0's copy from DDP's last broadcast, not updated since (the last
        # broadcasting forward ran in eval mode; the monitor sets it at every broadcast)
        self.buffers_from_broadcast = False
        #: per buffer, how much one broadcast bumps its version (None: not measured yet)
        self.broadcast_bumps: list[int] | None = None
        # the native extension's tensor_values, when it is loaded: a fingerprint in one call
        self.fingerprinter = Fingerprinter(self._deliver_fingerprint, tensor_values)
        self._grad_ready = torch_compat.available("grad_ready")
        self._post_forward = torch_compat.available("post_forward_timing", warn=False)
        self._join_warned = False
        #: whether ddpdoctor's all-reduce in effect (reads DDP's divisor, sees which gradients DDP
        #: divides in place): the attachment's answer (``Attachment.exact_scaling``)
        self.exact_scaling: Callable[[], tuple[bool, bool]] = lambda: (False, False)
        #: samples in a row that saw no gradient at all: the step's forward had no backward of its
        #: own (a model called twice before one backward, a GAN's discriminator): the next
        #: synchronizing forward samples instead, up to ``VOID_RESAMPLES`` times in a row
        self.void_samples = 0
        #: the routine forward asks ``sample_if_due`` from this step on (the schedule's next
        #: sampled step, or one before it), not at every step
        self.next_sample = 0
        #: DDP's map of the parameters each step used, read at every synchronizing step where
        #: that is cheap (find_unused_parameters on CPU), counted into the next Unused record
        self.used = UsedMap.of(ddp, self.params)
        # the reduction sentinel: the tensors DDP holds (its reducer's, by identity: DDP keeps
        # them alive), the module's parameters by name as of the last walk, and what was logged
        self._ddp_ids = {id(p) for p in getattr(ddp, "_module_parameters", None) or self.params}
        self._ignored_names = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        self.current: list[Any] = self.params  # per header name: the module's tensor now
        self.replaced: list[str] = []
        self.added: list[str] = []
        self.params_dirty = False
        self._idle_walks = 0  # walks in a row that a registration asked for and found nothing
        self._registration_hooks = _registration_hooks(weakref.ref(self))

    @property
    def ddp(self) -> Any:
        """The DDP instance (held weakly, as the monitor holds it; None once gone or closed)."""
        return self._ddp()

    @ddp.setter
    def ddp(self, ddp: Any) -> None:
        self._ddp = weakref.ref(ddp) if ddp is not None else lambda: None

    # -- every forward -------------------------------------------------------------------

    def on_step_start(self, step: int, t0_mono_ns: int, sync: bool, new_step: bool) -> None:
        """A training forward begins (``new_step``: the first of its step).

        ``StepHooks.on_forward_pre`` runs this unrolled where no sample is in progress, none is
        void and no fingerprint is pending (its routine branch): a change here is made there too."""
        if new_step:
            if sync and self.used is not None:
                self.used.step()  # (the step before's map: counted in the sample it ends, if any)
            if self.sample is not None:
                self.end_sample()
            if self.fingerprinter.pending:
                self.fingerprinter.poll()
        same = self.same_flags
        if same is None or not same(self.params, self.flag_bytes):  # (one native call: unchanged)
            self.check_grad_flags(step)
        if (
            sync
            and self.sample is None
            and (0 < self.void_samples <= VOID_RESAMPLES or is_sampled(step, self.check_every))
        ):
            self.begin_sample(step, t0_mono_ns)

    def sample_if_due(self, step: int, t0_mono_ns: int) -> None:
        """``on_step_start``'s sampling for a synchronizing forward with no sample in progress
        and none void, at or after ``next_sample`` (the routine forward's)."""
        if self.used is not None:  # read at every step: the routine forward asks at every step
            self.used.step()
            self.next_sample = step + 1
        else:
            self.next_sample = next_sampled(step + 1, self.check_every)
        if is_sampled(step, self.check_every):
            self.begin_sample(step, t0_mono_ns)

    def check_grad_flags(self, step: int) -> None:
        """Compare requires_grad with what DDP was built with: every forward, one C-level pass
        (``on_step_start`` asks the native extension first when it is loaded). A parameter or a
        submodule registered since the last forward (``params_dirty``) has the module walked."""
        if self.params_dirty:
            self.params_dirty = False
            self.flag_bytes = bytes(self.flags)  # (the native check was made to fail: see mark_dirty)
            if self.check_params(step):
                self._idle_walks = 0
            else:
                self._idle_walks += 1
                if self._idle_walks >= IDLE_WALKS:
                    # modules registered at every step that never touch this model (built inside a
                    # forward): the hooks go, the sampled steps walk it alone
                    self.stop()
        flags = list(map(_requires_grad, self.params))
        if flags == self.flags:
            return
        self.flags = flags
        self.flag_bytes = bytes(flags)
        self._emit_flags(step)

    def _emit_flags(self, step: int) -> None:
        flags = self.flags
        frozen = [n for n, r, f in zip(self.names, self.reduced, flags, strict=False) if r and not f]
        unfrozen = [
            n
            for n, r, f, i in zip(self.names, self.reduced, flags, self.ignored, strict=False)
            if f and not r and not i
        ]
        self._emit(
            GradFlags(
                rank=self.rank,
                ddp=self.ddp_index,
                step=step,
                frozen=frozen,
                unfrozen=unfrozen,
                replaced=list(self.replaced),
                added=list(self.added),
            )
        )

    # -- the reduction sentinel ------------------------------------------------------------

    def mark_dirty(self) -> None:
        """A module registered a parameter or a submodule (torch's global hooks; any module of the
        process): the next forward walks this model. The one-call requires_grad check is made to
        fail (bytes of another length) so that the routine forward takes ``check_grad_flags``,
        which nothing else costs a step."""
        self.params_dirty = True
        self.flag_bytes = b""

    def check_params(self, step: int) -> bool:
        """The module's parameters now against the tensors DDP reduces (by identity): one walk.
        True where what it found changed since the walk before (and was logged)."""
        ddp = self.ddp
        if ddp is None:
            return False
        known = set(self.names)
        now = dict(ddp.module.named_parameters())
        ours = self._ddp_ids
        ignored = self._ignored_names
        replaced: list[str] = []
        added: list[str] = []
        for name, p in now.items():
            if id(p) in ours or not p.requires_grad or name in ignored:
                continue
            (replaced if name in known else added).append(name)
        if replaced:  # the fingerprints follow the module's current tensors by name
            self.current = [now.get(n, p) for n, p in zip(self.names, self.params, strict=True)]
        else:
            self.current = self.params
        if replaced == self.replaced and added == self.added:
            return False
        self.replaced, self.added = replaced, added
        self._emit_flags(step)
        return True

    def stop(self) -> None:
        """Detached or closed: torch's global registration hooks go."""
        hooks, self._registration_hooks = self._registration_hooks, []
        for handle in hooks:
            handle.remove()

    # -- sampled steps --------------------------------------------------------------------

    def begin_sample(self, step: int, t0_mono_ns: int) -> None:
        if not self._join_warned:
            self._check_join()
        self.check_params(step)  # (a parameter put in a module's _parameters by hand: no hook says so)
        sample = self.sample = _Sample(step, t0_mono_ns)
        if self.broadcast_bumps is None and getattr(self.ddp, "modules_buffers", True):
            # (a model whose DDP has no buffers to broadcast never measures: a walk of every
            # module at every sample, for nothing)
            sample.pre_versions = self._buffer_versions()
        seen = sample.seen
        now = time.monotonic_ns
        if self._grad_ready:
            # (``flags`` is requires_grad as this forward read it: on_step_start, and the
            # routine forward, check the flags before a sample begins)
            if self._hooked is None or self._hooked[0] is not self.flags:
                flags = self.flags
                listed = [
                    (i, self.names[i]) for i, (r, f) in enumerate(zip(self.reduced, flags, strict=False)) if r and f
                ]
                self._hooked = (flags, listed, [self.params[i] for i, _ in listed])
            _, hooked, params = self._hooked
            sample.hooked = hooked  # (read only: shared by the samples until the flags change)
            native = self._param_sample
            # compiled autograd compiles the hooks of the graph it traces and knows Python hooks,
            # not a C++ one: where it may run, Python hooks stamp the arrivals
            if native is not None and not self.compiled_possible():
                sample.native = native(params)
            else:
                for i, _ in hooked:
                    sample.handles.append(
                        self.params[i].register_post_accumulate_grad_hook(lambda _p, i=i: seen.__setitem__(i, now()))
                    )
        ddp = self.ddp
        if torch_compat.buffer_sync(ddp) and getattr(ddp, "modules_buffers", True):
            # after DDP's own pre-forward (buffer broadcast), right before the wrapped module runs
            sample.handles.append(ddp.module.register_forward_pre_hook(self._on_module_pre))
        else:
            # DDP broadcasts no buffer in this forward, so the fingerprint is the same taken now:
            # no hook to register and remove (registering one costs more than the fingerprint's
            # own call on a small model: torch's registration code runs cold, once a sample)
            self.fingerprint(step, False)
        if not self._post_forward:
            return
        original = ddp._post_forward
        clock = HostClock()

        def timed_post_forward(output: Any) -> Any:
            ddp.__dict__.pop("_post_forward", None)
            start = clock.now()
            try:
                return original(output)
            finally:
                sample.post_forward_us = clock.us(start, clock.now())

        ddp.__dict__["_post_forward"] = timed_post_forward

    def _check_join(self) -> None:
        """Say once where ``Join(divide_by_initial_world_size=False)`` is not honoured.

        Without a comm hook, DDP divides a step's gradients by the ranks that have not joined.
        ddpdoctor's all-reduce reads that divisor from DDP's reducer through its native extension
        (``comm_hook.MeanState``); without the extension it divides by the world size, as torch's
        own ``allreduce_hook`` does, and steps after a rank joined get gradients scaled by (ranks
        training) / (world size). A user's comm hook does what it does without ddpdoctor. Checked
        on sampled steps only (no cost per step)."""
        ddp = self.ddp
        config = getattr(ddp, "_join_config", None)
        if not getattr(config, "enable", False) or getattr(ddp, "_divide_by_initial_world_size", True):
            return
        self._join_warned = True
        if self.exact_scaling()[0]:
            return
        warn(
            "ddpdoctor: Join(divide_by_initial_world_size=False) is not honoured while ddpdoctor times the "
            "buckets without its native extension: its comm hook then divides gradients by the world size, so "
            "after a rank joins the others' gradients are scaled by (ranks training) / (world size). Let the "
            "extension load (a C++ compiler, DDPDOCTOR_NATIVE not 0), use the default "
            "divide_by_initial_world_size=True, or train this job without ddpdoctor attached.",
            CommHookWarning,
            stacklevel=2,
        )

    def _on_module_pre(self, module: Any, args: Any) -> None:
        sample = self.sample
        if sample is None:
            return
        try:
            handle = sample.handles.pop()  # this hook: once per sample
            handle.remove()
            if self.broadcast_bumps is None and self.bcast_in_forward and sample.pre_versions is not None:
                after = self._buffer_versions()
                if len(after) == len(sample.pre_versions):  # only DDP's broadcast ran in between
                    self.broadcast_bumps = [max(0, a - b) for a, b in zip(after, sample.pre_versions, strict=True)]
            # a forward through the wrapper in eval mode (validation on every rank) broadcast the
            # buffers after the last training forward that did: they are still rank 0's copy here
            self.fingerprint(sample.step, self.bcast_in_forward or self.buffers_from_broadcast)
        except Exception as exc:  # a failing probe is reported and switched off; it must never break training
            if self._failed is None:
                raise
            with contextlib.suppress(Exception):  # its hooks off: the checks are not asked again
                self.end_sample()
            self._failed("checks", exc)

    def _buffers(self) -> list[Any]:
        """The module's buffers, in ``named_buffers`` order as of attach (one assigned anew since
        is read where it now is)."""
        return [b for d, name in self._buffer_slots if (b := d.get(name)) is not None]

    def _buffer_versions(self) -> list[int]:
        return [int(b._version) for b in self._buffers()]

    def fingerprint(self, step: int, after_broadcast: bool, final: bool = False) -> None:
        """Fingerprint every parameter and buffer now, as of ``step``."""
        buffers = self._buffers()
        versions = [int(b._version) for b in buffers]
        bumps = self.broadcast_bumps
        if bumps is not None and len(bumps) == len(versions) and self.broadcasts:
            # what DDP's own broadcasts added is no change of the buffer's (see the module docstring)
            versions = [v - self.broadcasts * d for v, d in zip(versions, bumps, strict=False)]
        # the module's parameters now, by the header's names (a parameter replaced after DDP was
        # built is compared across ranks as it trains, not as DDP's orphaned tensor)
        params = self.current
        meta = (step, len(params), versions, after_broadcast, final)
        self.fingerprinter.take(params + buffers, len(params), meta)

    def final(self, step: int) -> None:
        """The fingerprint at the end of the run (``close`` or a clean exit), delivered now.

        Taken outside any forward: each rank's own buffers after its own updates, which tells
        whether DDP's buffer broadcast is redundant or needed (``after_broadcast`` False). Unless
        the last forward that broadcast them ran in eval mode (an evaluation pass, with grad on or
        off): they are rank 0's copy then, on every rank (``after_broadcast`` True), and say
        nothing of the ranks' own updates. Divergence of broadcast buffers is still not reported
        (the next forward's broadcast resyncs them).
        """
        self.end_sample()
        self.fingerprint(step, self.buffers_from_broadcast, final=True)
        self.fingerprinter.drain()

    def _deliver_fingerprint(self, meta: Any, norms: list[float], sums: list[float], bits: list[int]) -> None:
        step, n, versions, after_broadcast, final = meta
        # (a norm or a sum that is not finite is null in the log: the record's lists admit None)
        param_norms: list[float | None] = list(norms[:n])
        buffer_norms: list[float | None] = list(norms[n:])
        buffer_sums: list[float | None] = list(sums)
        self._emit(
            Fingerprint(
                rank=self.rank,
                ddp=self.ddp_index,
                step=step,
                param_norms=param_norms,
                param_bits=bits[:n],
                buffer_norms=buffer_norms,
                buffer_sums=buffer_sums,
                buffer_bits=bits[n:],
                buffer_versions=versions,
                after_broadcast=after_broadcast,
                final=final,
            )
        )

    def end_sample(self) -> None:
        """Remove the sample's hooks and emit what it saw (idempotent)."""
        sample, self.sample = self.sample, None
        if sample is None:
            return
        for handle in sample.handles:
            handle.remove()
        hooked = sample.hooked
        if sample.native is not None:  # its hooks come off; the arrivals it stamped, per parameter hooked
            arrivals = sample.native.end(clocks.OFFSET_NS)
        else:  # (the Python hooks': by parameter index)
            seen = sample.seen
            arrivals = [seen.get(i) for i, _ in hooked]
        ddp = self.ddp
        if ddp is not None:
            ddp.__dict__.pop("_post_forward", None)
        if not self._grad_ready:
            return
        # per parameter, when its gradient arrived (µs from the step's start, to 0.1 µs; None: not
        # hooked, or no gradient), and the names of those hooked that got none: one pass, once a
        # sample. In whole 100 ns units, rounded half up, then tenths: ``round(x, 1)`` goes through
        # the float's decimal digits, 1-2 µs a parameter with cold caches (40 µs a sample of 18)
        t0 = sample.t0_mono_ns - 50
        ready: list[float | None] = [None] * len(self.params)
        names = []
        for (i, name), t in zip(hooked, arrivals, strict=True):
            if t is None:
                names.append(name)
            else:
                ready[i] = (t - t0) // 100 / 10
        if hooked and len(names) == len(hooked):
            # no parameter of the model got a gradient: no backward ran between this forward and
            # the next (DDP all-reduces after the backward of its last forward), which says
            # nothing about unused parameters; the next synchronizing forward samples instead
            self.void_samples += 1
            return
        self.void_samples = 0
        read, with_unused, changes, ever = self.used.take() if self.used is not None else (0, 0, 0, None)
        # of the parameters unused at this sample, those DDP's map saw used on a step in between:
        # its order is DDP's, that of the reduced parameters (ignored, frozen at wrap: not in it)
        between = self._used_between(names, ever) if ever is not None and names else []
        self._emit(
            Unused(
                rank=self.rank,
                ddp=self.ddp_index,
                step=sample.step,
                names=names,
                post_forward_us=sample.post_forward_us,
                param_ready_us=ready,
                steps_read=read,
                steps_with_unused=with_unused,
                unused_set_changes=changes,
                used_between=between,
            )
        )

    def _used_between(self, names: list[str], ever: list[bool]) -> list[str]:
        order = [n for n, r in zip(self.names, self.reduced, strict=False) if r]
        if len(order) != len(ever):
            return []  # not DDP's order as the header saw it (a parameter frozen since): said nothing
        used = {n for n, e in zip(order, ever, strict=True) if e}
        return [n for n in names if n in used]


def _registration_hooks(checks: weakref.ref[SampledChecks]) -> list[Any]:
    """torch's global parameter and submodule registration hooks, which mark ``checks`` dirty
    (held weakly: the hooks outlive nothing of it); none where this torch has no such hooks."""
    try:
        from torch.nn.modules.module import (
            register_module_module_registration_hook,
            register_module_parameter_registration_hook,
        )
    except ImportError:  # (older torch: the sampled steps walk the module alone)
        return []

    def registered(module: Any, name: str, value: Any) -> None:
        target = checks()
        if target is not None:
            target.mark_dirty()

    return [
        register_module_parameter_registration_hook(registered),
        register_module_module_registration_hook(registered),
    ]
