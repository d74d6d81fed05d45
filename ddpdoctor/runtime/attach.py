"""ddpdoctor's changes to a DDP instance, made as one transaction, undone by ``detach()``.

``Attachment.open`` either makes every change or none: it validates and builds everything first
(the header, the hook state, the functions it will put on the instance), then makes the changes
in ``STEPS`` order, each with its undo. If a step fails, the steps already made are undone in
reverse order and ``AttachError`` says which step failed: DDP is left exactly as it was (same
hooks, still all-reducing through its own reducer), and nothing refers to it.

The changes that cannot be undone come last: the comm hook (a reducer takes exactly one, for
good), and, when the reducer was rebuilt, removing the old reducer's autograd hooks. A comm hook
the user registered *before* ``instrument`` means a fresh reducer: it is built beside the old
one (whose autograd hooks stay in place until the new reducer carries ddpdoctor's hook), and
only then are the old reducer's hooks removed. After ``detach`` the timed hook stays registered
and passes every bucket to the inner (the user's, or DDP's own) hook without timing anything,
and later ``register_comm_hook`` calls still fill that inner slot, under DDP's own "only once"
rule.

On the native route (``native_hook``: CPU model, no hook registered before, the extension
loaded) the "comm_hook" step registers ddpdoctor's C++ timed hook instead, with two forward hooks
for its per-step Python side; if the reducer refuses it, that step falls back to the Python hook.
After ``detach`` the native hook stays too, all-reducing and stamping nothing.

Fault injection (tests): ``fail_at`` (or ``$DDPDOCTOR_TEST_FAIL_ATTACH``) names a step of
``STEPS`` to fail at.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from ddpdoctor.categories import CommHookWarning, warn
from ddpdoctor.errors import SetupError
from ddpdoctor.events import Header, environment
from ddpdoctor.runtime import torch_compat
from ddpdoctor.runtime.disabled import DisabledMonitor
from ddpdoctor.runtime.step import comm_hook, native_hook

#: Every step of the transaction, in order ("validate" and "build" change nothing).
STEPS = (
    "validate",
    "build",
    "forward_hooks",
    "sync_buffers",
    "copy_state",
    "shadow_registration",
    "services",
    "register",
    "rebuild_reducer",
    "comm_hook",
    "retire_old_reducer",
)
#: Test-only: the step to fail at (also read from this environment variable).
FAIL_ENV = environment.TEST_FAIL_ATTACH_ENV
fail_at: str | None = None

#: What ddpdoctor puts in a DDP instance's ``__dict__`` (removed from copies and pickles).
SHADOWED = ("_sync_buffers", "_post_forward", "__getstate__", *comm_hook.SHADOWS)

#: The monitor attached to each DDP instance.
_attached: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _nothing() -> None:
    return None


class AttachError(SetupError, RuntimeError):
    """Attaching failed at ``step``; DDP was left as it was."""

    def __init__(self, step: str, cause: BaseException) -> None:
        super().__init__(
            f"attach step '{step}' failed ({type(cause).__name__}: {cause}); the DDP model was left exactly as it was"
        )
        self.step = step
        self.cause = cause


class InjectedFault(SetupError, RuntimeError):
    """Raised by the fault injection of the tests."""


def monitor_of(ddp: Any) -> Any:
    """The live monitor attached to ``ddp``, if any."""
    monitor = _attached.get(ddp)
    return monitor if monitor is not None and not monitor.closed else None


def _maybe_fail(step: str) -> None:
    if step in (fail_at, environment.read(FAIL_ENV)):
        raise InjectedFault(f"injected failure at attach step '{step}'")


class Attachment:
    """ddpdoctor's changes to one DDP instance for one monitor (``open``, then ``detach``)."""

    def __init__(self, ddp: Any, monitor: Any) -> None:
        self._ddp: Callable[[], Any] = weakref.ref(ddp)
        self.monitor = monitor
        #: the monitor's probes (``StepHooks``): what the forward hooks, the buffer broadcast's
        #: shadow, the comm hook and the native side call
        self.hooks = monitor.hooks
        self.header: Header | None = None
        self.hook_state: comm_hook.HookState | None = None
        #: Why per-bucket timing is off on this instance (None: it is on).
        self.timing_off: str | None = None
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._handles: list[Any] = []
        self._existing: tuple[Callable[..., Any], object, str] | None = None
        #: The native comm hook (DDP's default all-reduce timed in C++); None: the Python route.
        self.native: native_hook.NativeTiming | None = None
        self._sync_buffers: Callable[[], Any] | None = None  # the shadow (``_build``)
        self._prior_sync: Any = None

    @property
    def ddp(self) -> Any:
        """The DDP instance (None once detached, or once the script let it go): held weakly, so
        that a model the script drops is freed by reference counting, as a plain DDP is."""
        return self._ddp()

    @ddp.setter
    def ddp(self, ddp: Any) -> None:
        self._ddp = weakref.ref(ddp) if ddp is not None else _nothing

    @classmethod
    def open(
        cls,
        ddp: Any,
        monitor: Any,
        header: Callable[[Any], Header],
        extra: tuple[tuple[str, Callable[[], None], Callable[[], None]], ...] = (),
    ) -> Attachment:
        """Attach ``monitor`` to ``ddp``: every change, or none (``AttachError``).

        ``header(ddp)`` builds the header (emitted by the caller once this succeeds); ``extra``
        are (name, do, undo) steps of the caller's, run before the final registration.
        """
        self = cls(ddp, monitor)
        step = "validate"
        try:
            _maybe_fail(step)
            self._validate()
            step = "build"
            _maybe_fail(step)
            self.header = header(ddp)
            self._build()
            for step, do in self._plan(extra):
                _maybe_fail(step)
                do()
        except BaseException as exc:
            self._rollback()
            raise AttachError(step, exc) from exc
        # done: the undo steps (a snapshot of the instance's state among them) are not needed
        self._undo = []
        return self

    # -- validate and build: nothing changes -------------------------------------------

    def _validate(self) -> None:
        try:
            self._existing = comm_hook.check_supported(self.ddp)
        except comm_hook.HookUnsupported as exc:
            self.timing_off = str(exc)
        if self.ddp in _attached and monitor_of(self.ddp) is not None:
            raise RuntimeError("this DDP instance is already instrumented")

    def _build(self) -> None:
        hooks, ddp = self.hooks, self.ddp
        if self.timing_off is None:
            state = comm_hook.HookState(hooks, comm_hook.mean_allreduce, comm_hook.MeanState(ddp.process_group))
            if self._existing is not None:
                state.inner_hook, state.inner_state, state.user_hook_name = self._existing
            self.hook_state = state
            if self._existing is None:
                self._choose_native(ddp, state)
        original = ddp._sync_buffers if torch_compat.available("buffer_timing") else None
        # The shadow lives in the instance's __dict__: a strong bound method there would be a
        # cycle through the instance, which reference counting alone never frees. So it holds
        # the model weakly and binds DDP's method at each call (``__get__``, in C), and it is a
        # ``partial`` (in C too): a broadcasting forward enters one Python frame of ours, the
        # monitor's, where a closure and a ``WeakMethod`` would each add one.
        self._sync_buffers = None
        # one another tool set on the instance before ours: put back at detach, not dropped
        self._prior_sync = ddp.__dict__.get("_sync_buffers")
        if original is not None:
            bind: Callable[[Any], Callable[[], Any]]
            if inspect.ismethod(original) and original.__self__ is ddp:
                bind = original.__func__.__get__
            else:  # (one set on the instance before ours: called as it is)

                def bind(_model: Any, original: Any = original) -> Callable[[], Any]:
                    return original  # type: ignore[no-any-return]

            self._sync_buffers = functools.partial(hooks.on_sync_buffers, bind, weakref.ref(ddp))
        self._getstate = _state_without_ddpdoctor(ddp)

    def _choose_native(self, ddp: Any, state: comm_hook.HookState) -> None:
        """The native route when its extension loads and takes this DDP (CPU models, DDP's default
        all-reduce, no hook registered before). A user hook registered later is handed the buckets
        by the native hook, through ``comm_hook.timed_hook`` (the Python route times it)."""
        module = native_hook.choose(cuda=bool(self.monitor.cuda))
        if module is None:
            return
        native = native_hook.NativeTiming(module, ddp, self.hooks)
        try:
            native.check(ddp)
        except Exception as exc:  # noqa: BLE001 - the extension cannot take this DDP: the Python route, said once
            native_hook.choose_failed(f"{type(exc).__name__}: {exc}")
            return
        self.native = native

        def python_route() -> None:
            native.delegate(state, comm_hook.timed_hook)

        state.on_user_hook = python_route
        if self.header is not None:
            self.header.timing = "native"

    def _plan(
        self, extra: tuple[tuple[str, Callable[[], None], Callable[[], None]], ...]
    ) -> list[tuple[str, Callable[[], None]]]:
        plan: list[tuple[str, Callable[[], None]]] = [
            ("forward_hooks", self._add_forward_hooks),
            ("sync_buffers", self._shadow_sync_buffers),
            ("copy_state", self._shadow_getstate),
        ]
        if self.hook_state is not None:
            plan.append(("shadow_registration", self._shadow_registration))
        for name, do, undo in extra:
            plan.append((name, self._with_undo(name, do, undo)))
        plan.append(("register", self._register))
        # the irreversible ones last: nothing after them can fail and need them undone
        if self.hook_state is not None:
            if self._existing is not None:
                plan.append(("rebuild_reducer", self._rebuild_reducer))
            plan.append(("comm_hook", self._arm_native if self.native is not None else self._register_comm_hook))
            if self._existing is not None:
                plan.append(("retire_old_reducer", self._retire_old_reducer))
        return plan

    def _with_undo(self, name: str, do: Callable[[], None], undo: Callable[[], None]) -> Callable[[], None]:
        def step() -> None:
            do()
            self._undo.append((name, undo))

        return step

    # -- the changes, each with its undo -------------------------------------------------

    def _add_forward_hooks(self) -> None:
        ddp, hooks = self.ddp, self.hooks
        self._handles.append(ddp.register_forward_pre_hook(hooks.on_forward_pre, prepend=True))
        self._undo.append(("forward_hooks", self._remove_forward_hooks))
        self._handles.append(ddp.register_forward_hook(hooks.on_forward_post, always_call=True))

    def hook_ids(self) -> set[int]:
        """The ids of the forward hooks this attachment registered (a copy leaves them out)."""
        return {h.id for h in self._handles}

    def _remove_forward_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _shadow_sync_buffers(self) -> None:
        if self._sync_buffers is None:
            return
        self.ddp.__dict__["_sync_buffers"] = self._sync_buffers
        self._undo.append(("sync_buffers", lambda: self._unshadow_sync_buffers(self.ddp)))

    def _unshadow_sync_buffers(self, ddp: Any) -> None:
        """DDP's own ``_sync_buffers`` again, or the one set on the instance before ours."""
        if self._prior_sync is not None:
            ddp.__dict__["_sync_buffers"] = self._prior_sync
        else:
            ddp.__dict__.pop("_sync_buffers", None)

    def _shadow_getstate(self) -> None:
        if "__getstate__" in self.ddp.__dict__:
            return  # attached before (a closed monitor's): the same function serves
        self.ddp.__dict__["__getstate__"] = self._getstate
        self._undo.append(("copy_state", lambda: self.ddp.__dict__.pop("__getstate__", None)))

    def _shadow_registration(self) -> None:
        saved = {name: self.ddp.__dict__[name] for name in comm_hook.SHADOWS if name in self.ddp.__dict__}
        assert self.hook_state is not None
        comm_hook.shadow_registration(self.ddp, self.hook_state)

        def undo() -> None:
            for name in comm_hook.SHADOWS:
                self.ddp.__dict__.pop(name, None)
            self.ddp.__dict__.update(saved)

        self._undo.append(("shadow_registration", undo))

    def _rebuild_reducer(self) -> None:
        ddp = self.ddp
        snapshot = dict(ddp.__dict__)
        self._old_reducer = old = ddp.reducer

        def undo() -> None:
            new = ddp.__dict__.get("reducer")
            if new is not None and new is not old:
                torch_compat.remove_reducer_hooks(new)
            ddp.__dict__.clear()
            ddp.__dict__.update(snapshot)

        self._undo.append(("rebuild_reducer", undo))
        # the new reducer registers its autograd hooks beside the old one's; the old ones go last
        torch_compat.build_reducer(ddp)

    def _register_comm_hook(self) -> None:
        ddp, state = self.ddp, self.hook_state
        assert state is not None
        if isinstance(state.inner_state, comm_hook.MeanState):  # ddpdoctor's own all-reduce
            state.inner_state.scale = native_hook.python_route_scale(ddp, bool(self.monitor.cuda))
        torch_compat.register_comm_hook(ddp.reducer, state, comm_hook.timed_hook)
        if self._existing is not None and ddp.logger is not None:
            ddp.logger._set_comm_hook_name(self._existing[2])

    def _arm_native(self) -> None:
        """Native route: the native comm hook on the reducer. Its per-step Python side runs in the
        monitor's own hooks (forward, optimizer), which call it: no hook of its own."""
        ddp, native = self.ddp, self.native
        assert native is not None
        try:
            native.register(ddp)
        except Exception as exc:  # noqa: BLE001 - the reducer refused the native hook: the Python route, said once
            native_hook.choose_failed(f"{type(exc).__name__}: {exc}")
            self.native = None
            assert self.hook_state is not None
            self.hook_state.on_user_hook = None
            if self.header is not None:
                self.header.timing = "python"
            self._register_comm_hook()

    def exact_scaling(self) -> tuple[bool, bool]:
        """Whether ddpdoctor's own all-reduce, if it is the one in effect, (reads DDP's divisor,
        sees which gradients DDP would divide in place): both True where it is not in effect (a
        user's hook scales as it does without ddpdoctor) or where the native extension scales."""
        state = self.hook_state
        if state is None or state.inner_hook is not comm_hook.mean_allreduce:
            return True, True
        if self.native is not None and not self.native.delegated:
            reads, watches = self.native.exact
        else:
            scale = state.inner_state.scale if isinstance(state.inner_state, comm_hook.MeanState) else None
            if scale is None:
                return False, False
            reads, watches = bool(scale.reads_divisor), bool(scale.watches)
        return reads, watches or not getattr(self.ddp, "gradient_as_bucket_view", False)

    def warn_inexact_views(self, stacklevel: int) -> None:
        """Warn where ddpdoctor's own all-reduce cannot divide the gradients as DDP does (the
        Python route, without the extension, on bucket views at a world size above one)."""
        ddp = self.ddp
        if native_hook.views_divided_inexactly(ddp) and not self.exact_scaling()[1]:
            warn(
                f"ddpdoctor: gradient_as_bucket_view=True at a world size of {ddp.process_group.size()}: "
                "without its native extension ddpdoctor's comm hook multiplies every gradient by 1/world "
                "size, where DDP divides the gradients kept between steps (zero_grad(set_to_none=False)) in "
                "place: their last bits can differ. Let the extension load (a C++ compiler, DDPDOCTOR_NATIVE "
                "not 0), or let zero_grad set the gradients to None.",
                CommHookWarning,
                stacklevel=stacklevel + 1,
            )

    def _retire_old_reducer(self) -> None:
        torch_compat.remove_reducer_hooks(self._old_reducer)
        self._old_reducer = None

    def _register(self) -> None:
        _attached[self.ddp] = self.monitor
        self._undo.append(("register", lambda: _attached.pop(self.ddp, None)))

    def _rollback(self) -> None:
        while self._undo:
            _, undo = self._undo.pop()
            try:
                undo()
            except Exception:  # noqa: BLE001, S110 - undo the rest regardless; the caller reports the failed step
                pass
        if self.hook_state is not None:
            self.hook_state.detach()

    # -- after a successful open ---------------------------------------------------------

    def detach(self) -> None:
        """Undo what can be undone; the comm hook stays and passes through without timing."""
        if self.ddp is None:
            return
        ddp = self.ddp
        self._remove_forward_hooks()
        if self._sync_buffers is not None:
            self._unshadow_sync_buffers(ddp)
        ddp.__dict__.pop("_post_forward", None)
        if _attached.get(ddp) is self.monitor:
            del _attached[ddp]
        if self.hook_state is not None:
            self.hook_state.detach()
        if self.native is not None:
            self.native.stop()
        self._undo = []
        # the shadow, and a _sync_buffers set on the instance before it (which may close over the
        # model), are the model's to hold: a monitor the user keeps must not keep the model (and
        # its reducer and process group) alive once detached
        self._sync_buffers = self._prior_sync = None
        self.ddp = None


def _state_without_ddpdoctor(ddp: Any) -> Callable[[], dict[str, Any]]:
    """An instance ``__getstate__``: DDP's own, less everything ddpdoctor added.

    ``copy.deepcopy`` and ``torch.save`` of an instrumented DDP then give what they give for a
    plain DDP: an uninstrumented copy (DDP's ``__setstate__`` builds it a reducer of its own,
    without any comm hook, as for any copy); the original keeps its monitor.
    """
    ddp_ref = weakref.ref(ddp)

    def __getstate__() -> dict[str, Any]:
        ddp: Any = ddp_ref()  # called on the instance itself: it is alive
        monitor = monitor_of(ddp)
        if monitor is not None:
            monitor.quiesce()  # a sample in progress holds hooks on the parameters: end it
        state: dict[str, Any] = type(ddp).__getstate__(ddp)
        for name in SHADOWED:
            state.pop(name, None)
        if "ddpdoctor" in state:  # the drop-in class's attribute: a copy is not monitored
            state["ddpdoctor"] = DisabledMonitor()
        own = _own_hooks(monitor)
        for name in (
            "_forward_pre_hooks",
            "_forward_hooks",
            "_forward_hooks_always_called",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
        ):
            hooks = state.get(name)
            if hooks and own:
                state[name] = type(hooks)((k, v) for k, v in hooks.items() if k not in own)
        return state

    return __getstate__


def _own_hooks(monitor: Any) -> set[int]:
    attachment = getattr(monitor, "attachment", None) if monitor is not None else None
    return attachment.hook_ids() if attachment is not None else set()
