"""Per-bucket timing through DDP's communication hook, keeping the user's own hook working.

DDP accepts exactly one comm hook per reducer. ddpdoctor registers ``timed_hook``, which calls
the *inner* hook: the user's, or one doing what DDP does by default (scale by 1/world size, then
all-reduce; bit-identical results). A user hook registered after ``instrument`` is routed to the
inner slot by shadowing ``register_comm_hook`` on the instance. A hook registered before is
found in ``ddp._comm_hooks``; since the reducer will not take a second one, the reducer is
rebuilt the way DDP itself rebuilds it when unpickled, with the same parameters
(``runtime/attach.py`` does that, as one step of its transaction).

On the native route (``runtime/step/native_hook.py``: DDP's default all-reduce timed in C++) the
native hook is the one on the reducer. A user hook registered after ``instrument`` (at any time,
as with plain DDP) is handed every bucket by the native hook, through ``timed_hook``, which
times it as on the Python route; a second one gets DDP's "can only be called once" error.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddpdoctor.errors import SetupError
from ddpdoctor.events import BucketInfo
from ddpdoctor.runtime import torch_compat

if TYPE_CHECKING:
    from ddpdoctor.runtime.protocols import BucketObserver

_ONCE_MSG = "register_comm_hook or register_builtin_comm_hook can only be called once."

_BUILTIN_EQUIVALENTS: dict[str, Callable[..., Any]] = {
    "ALLREDUCE": default_hooks.allreduce_hook,
    "FP16_COMPRESS": default_hooks.fp16_compress_hook,
}


class HookUnsupported(SetupError, RuntimeError):
    """This DDP instance's communication cannot be timed (message says why and what to do)."""


class HookState:
    """State of ``timed_hook``: the observer (weak: the hook outlives it) and the inner hook."""

    __slots__ = (
        "_monitor",
        "inner_hook",
        "inner_state",
        "user_hook_name",
        "on_user_hook",
        "__weakref__",
    )

    def __init__(self, monitor: BucketObserver, inner_hook: Callable[..., Any], inner_state: object) -> None:
        self._monitor = weakref.ref(monitor)
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.user_hook_name: str | None = None
        #: Native route: hands the buckets to ``timed_hook`` (a user hook was registered after
        #: instrument, so the Python route times it). None on the Python route.
        self.on_user_hook: Callable[[], None] | None = None

    @property
    def monitor(self) -> BucketObserver | None:
        return self._monitor()

    def detach(self) -> None:
        """After ``close``: the hook keeps calling the inner hook and times nothing."""
        self._monitor = lambda: None  # type: ignore[assignment]


class MeanState:
    """``mean_allreduce``'s state: the process group, and the native extension's ``DdpScale``
    where it loads (``native_hook.ddp_scale``), which scales each bucket exactly as DDP's reducer
    would have: by DDP's own divisor (under ``Join(divide_by_initial_world_size=False)``, the ranks
    still training), multiplying a gradient DDP copies and dividing one that stays its bucket view
    (``gradient_as_bucket_view``). Without it (None), every bucket is multiplied by 1/world size,
    which gives DDP's bits except in those two cases at a world size that is not a power of two
    (said once, ``CommHookWarning``)."""

    __slots__ = ("group", "scale")

    def __init__(self, group: dist.ProcessGroup, scale: Any = None) -> None:
        # (``scale``: the extension's DdpScale, called with a bucket; None: the reciprocal, multiplied)
        self.group = group
        self.scale = scale


def mean_allreduce(state: MeanState, bucket: dist.GradBucket) -> torch.futures.Future[Any]:
    """What DDP does without a hook: scale (by 1/world size, or as ``MeanState`` says), then sum
    across ranks.

    Bit-identical to DDP's built-in path, which multiplies each gradient by the reciprocal as it
    copies it into the bucket (a divide gives other bits whenever the world size is not a power
    of two; ``MeanState`` says where DDP divides). It calls the process group directly: the
    public ``dist.all_reduce`` wrapper costs several microseconds per bucket in argument checks
    and logging. The future's value is a one-element list; ``timed_hook`` unwraps it.

    A CUDA bucket at world size 1 is not multiplied: by 1.0 it changes no bit there (CUDA kernels
    keep subnormals), and that pass over every gradient is what a scaling comm hook costs a GPU
    (+0.5% of a 65 ms transformer step on an H200, +0.1% for the same hook without it: DDP without
    a hook scales as it copies into the bucket, with one it copies, and the hook's multiply is a
    second pass). On CPU it stays: a process that flushes denormals (``torch.set_flush_denormal``)
    zeroes them in DDP's multiply.
    """
    tensor = bucket.buffer()
    group = state.group
    scale = state.scale
    if scale is not None:
        scale(bucket)  # (the same rules, in C++)
    else:
        size = group.size()
        if size != 1 or not tensor.is_cuda:
            tensor.mul_(1.0 / size)
    return group.allreduce([tensor]).get_future()


class _Then:
    """A bucket future's callback: unwraps ``mean_allreduce``'s one-element list and marks the
    bucket done (``recorder`` None: nothing to time).

    The gloo worker thread that completes the future runs it, then drops it, which needs the
    GIL. One that has run is kept in ``_ran`` (weakly) until the worker has let it go: at exit
    ``release_callbacks`` waits for that, so no worker still needs the GIL once the interpreter
    is finalizing (where a thread that asks for it is made to exit and the process aborts).
    """

    __slots__ = ("recorder", "probes", "step", "index", "unwrap", "__weakref__")

    def __init__(self, recorder: Any, probes: Any, step: Any, index: int, unwrap: bool) -> None:
        self.recorder = recorder
        self.probes = probes
        self.step = step
        self.index = index
        self.unwrap = unwrap

    def __call__(self, f: torch.futures.Future[Any]) -> Any:
        try:
            if self.recorder is not None:
                try:
                    self.recorder.bucket_done(self.step, self.index)
                except Exception as exc:  # noqa: BLE001 - runs inside DDP's backward: a failing probe is switched off, never breaks training
                    self.probes.failed("buckets", exc)
            return f.value()[0] if self.unwrap else f.value()
        finally:
            _ran.add(self)


#: Callbacks that have run and that a gloo worker may not have released yet.
_ran: weakref.WeakSet[_Then] = weakref.WeakSet()
#: How long the exit waits, at most, for the workers to release them.
RELEASE_WAIT_S = 1.0


def _then(fut: torch.futures.Future[Any], callback: _Then) -> torch.futures.Future[Any]:
    return torch_compat.without_backward_context(fut.then, callback)  # type: ignore[no-any-return]


def release_callbacks(timeout: float = RELEASE_WAIT_S) -> bool:
    """Wait until no gloo worker still holds a callback of ours (at exit, before the interpreter
    finalizes; the GIL is free meanwhile). True when none is left."""
    deadline = time.monotonic() + timeout
    while len(_ran) and time.monotonic() < deadline:
        time.sleep(0.001)
    return not len(_ran)


atexit.register(release_callbacks)


def timed_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The registered comm hook: timestamps around the inner hook, never in its way."""
    monitor = state.monitor
    inner = state.inner_hook
    unwrap = inner is mean_allreduce
    step = None
    index = -1
    if monitor is not None and monitor.probes.on["buckets"]:
        try:
            index = bucket.index()
            step = monitor.on_bucket_ready(bucket, index)
        except Exception as exc:  # noqa: BLE001 - runs inside DDP's backward: a failing probe is switched off, never breaks training
            monitor.probes.failed("buckets", exc)
            step = None
    if monitor is not None:
        watch = getattr(monitor, "nonfinite", None)
        if watch is not None and not watch.reported:
            try:  # this rank's own gradients, before the inner hook averages them
                watch.check_bucket(bucket, -1)
            except Exception as exc:  # noqa: BLE001 - runs inside DDP's backward: a failing probe is switched off, never breaks training
                watch.mark_reported()
                monitor.probes.failed("checks", exc)
    if unwrap:  # ddpdoctor's own all-reduce: its gloo work holds no Python context
        fut = torch_compat.without_backward_context(inner, state.inner_state, bucket)
    else:
        fut = inner(state.inner_state, bucket)  # the user's errors propagate untouched
    if step is None or monitor is None:  # a step exists only with a monitor
        return _then(fut, _Then(None, None, None, index, True)) if unwrap else fut
    recorder = monitor.recorder
    probes = monitor.probes
    try:
        recorder.bucket_launched(step, index)
    except Exception as exc:  # noqa: BLE001 - runs inside DDP's backward: a failing probe is switched off, never breaks training
        probes.failed("buckets", exc)
        return _then(fut, _Then(None, None, None, index, True)) if unwrap else fut
    return _then(fut, _Then(recorder, probes, step, index, unwrap))


def bucket_info(bucket: dist.GradBucket, names: dict[int, str]) -> BucketInfo:
    buf = bucket.buffer()
    return BucketInfo(
        index=bucket.index(),
        params=[names.get(id(p), "?") for p in bucket.parameters()],
        bytes=buf.numel() * buf.element_size(),
        dtype=str(buf.dtype).removeprefix("torch."),
    )


def check_supported(ddp: Any) -> tuple[Callable[..., Any], object, str] | None:
    """The user's hook already registered on ``ddp`` (None: none), or ``HookUnsupported``.

    Changes nothing: the attach transaction calls it before its first step.
    """
    if not torch_compat.available("comm_hook"):
        raise HookUnsupported(f"torch {torch_compat.TORCH_VERSION}: {torch_compat.problem('comm_hook')}")
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        raise HookUnsupported("this DDP runs without a C++ reducer (compiled DDP or all parameters delayed)")
    existing = _registered_hook(ddp)
    if existing is None:
        return None
    if not torch_compat.available("reducer_rebuild"):
        raise HookUnsupported(
            f"a comm hook registered before instrument cannot be timed on torch "
            f"{torch_compat.TORCH_VERSION}: {torch_compat.problem('reducer_rebuild')}"
        )
    if getattr(ddp, "mixed_precision", None) is not None:
        raise HookUnsupported("DDP's native mixed precision registers its own comm hook")
    old_count, new_count = torch_compat.reducer_parameter_count(ddp)
    if old_count is not None and old_count != new_count:
        # requires_grad changed since DDP was built: a new reducer would silently change what is
        # synchronized, which is training's business, not ours.
        raise HookUnsupported(
            "requires_grad changed since DDP was built; call ddpdoctor.instrument before registering the comm hook"
        )
    return existing


def _registered_hook(ddp: Any) -> tuple[Callable[..., Any], object, str] | None:
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if hooks:
        hook, hook_state = hooks[-1]
        return hook, hook_state, getattr(hook, "__qualname__", repr(hook))
    try:
        name = str(torch_compat.logging_data(ddp).get("comm_hook", "") or "")
    except Exception:  # noqa: BLE001 - the hook's name from DDP's private logging data is optional; never break training
        name = ""
    if name.startswith("BuiltinCommHookType."):
        kind = name.split(".", 1)[1]
        if kind not in _BUILTIN_EQUIVALENTS:
            raise HookUnsupported(f"built-in comm hook {name} has no Python equivalent to time it with")
        return _BUILTIN_EQUIVALENTS[kind], ddp.process_group, name
    if name:
        raise HookUnsupported(f"a comm hook ({name}) was registered in a way ddpdoctor cannot see")
    return None


SHADOWS = ("register_comm_hook", "_register_builtin_comm_hook")


def shadow_registration(ddp: Any, state: HookState) -> None:
    """Make later ``register_comm_hook`` calls fill the inner slot instead of failing."""
    ddp_ref = weakref.ref(ddp)  # these functions live in ddp.__dict__: no cycle back to it

    def register_comm_hook(hook_state: object, hook: Callable[..., Any]) -> None:
        ddp: Any = ddp_ref()  # called as a method of the live instance: it is alive
        ddp._check_comm_hook(hook)
        if state.user_hook_name is not None:
            raise RuntimeError(_ONCE_MSG)
        _take_python_route(state)
        name = getattr(hook, "__qualname__", repr(hook))
        if ddp.logger is not None:
            ddp.logger._set_comm_hook_name(name)
        ddp._comm_hooks.append((hook, hook_state))
        state.inner_hook, state.inner_state, state.user_hook_name = hook, hook_state, name
        _announce(state)

    def register_builtin_comm_hook(comm_hook_type: Any) -> None:
        ddp: Any = ddp_ref()  # called as a method of the live instance: it is alive
        kind = str(comm_hook_type).split(".")[-1]
        if kind not in _BUILTIN_EQUIVALENTS:
            raise RuntimeError(f"ddpdoctor cannot time the built-in comm hook {comm_hook_type}")
        if state.user_hook_name is not None:
            raise RuntimeError(_ONCE_MSG)
        _take_python_route(state)
        if ddp.logger is not None:
            ddp.logger._set_comm_hook_name(str(comm_hook_type))
        state.inner_hook, state.inner_state = _BUILTIN_EQUIVALENTS[kind], ddp.process_group
        state.user_hook_name = str(comm_hook_type)
        _announce(state)

    ddp.__dict__["register_comm_hook"] = register_comm_hook
    ddp.__dict__["_register_builtin_comm_hook"] = register_builtin_comm_hook


def _take_python_route(state: HookState) -> None:
    """Native route, a user hook registered after instrument: the native hook hands the buckets
    to ``timed_hook``, which times the user's hook as on the Python route."""
    route, state.on_user_hook = state.on_user_hook, None
    if route is not None:
        route()


def _announce(state: HookState) -> None:
    """The header was written at attach: the next layout record names the hook now in effect."""
    monitor = state.monitor
    if monitor is None:
        return
    try:
        monitor.recorder.set_comm_hook(state.user_hook_name)
    except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
        monitor.probes.failed("layout", exc)
