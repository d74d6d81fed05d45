"""Per-bucket timing at C++ cost: the native comm hook, its build, and its Python side.

The hook (``native/comm_hook.h``) does what DDP does without a hook (scale each bucket as DDP
would, ``ddp_scale``; all-reduce it) and stamps ready, launch and done per bucket on the monotonic
clock (the clock of ``time.perf_counter_ns``) into a fixed-size ring. No Python runs per bucket and no
GIL is taken on the comm thread; Python drains the ring once per step.

The backward's compute end is stamped in C++ as well: the first bucket of each backward (each
autograd graph task) queues an autograd final callback, which runs once the graph is done and
before DDP's own finalization. Nothing is hooked on the forward's output. Where compiled autograd
may trace the backward (it knows Python hooks and callbacks, not ours), Python stamps it instead:
hooks on the output (``arm_python``), then ``on_output_grad`` and ``on_backward_end``.

Per step, ``NativeTiming`` adds (all on the training thread):

- ``on_sync_forward`` as the synchronizing forward begins: marks the step's stamps as pending
  (and asks for the layout at the steps that capture it);
- ``drain``, called by the monitor at its next hook of the step, which runs anyway (the next
  forward's pre-hook, close, rewrap, a user hook's delegation): the ring's stamps go into the
  step (``drain_into``; out of order, ``StepRecorder.add_bucket_columns``). Until then the hang watchdog reads them
  (``in_flight``, ``backward_ended``) when it reports a stall, to name the phase and the pending
  bucket.

The build: ``torch.utils.cpp_extension`` in a child process (so its compiler, environment and a
stale lock never touch the training process), under torch's own build lock, cached in torch's
extension directory under a name that holds the torch version and the source's hash. Loading a
cached build is an import of the shared object (milliseconds). ``ddpdoctor run`` and ``ddpdoctor
demo`` build it before starting ranks (``python -m ddpdoctor.runtime.native``).

Selection (``choose``): the native hook times DDP's default all-reduce on CPU models when it
builds and loads; otherwise the Python comm hook does (``comm_hook.timed_hook``), said once
(``CommHookWarning``). ``DDPDOCTOR_NATIVE=0`` forces the Python route.
"""

from __future__ import annotations

import collections.abc
import importlib.util
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import ddpdoctor.native_cache as native_cache
from ddpdoctor.categories import CommHookWarning, warn
from ddpdoctor.errors import SetupError
from ddpdoctor.events import environment
from ddpdoctor.runtime import torch_compat
from ddpdoctor.runtime.step import clocks
from ddpdoctor.runtime.step.recorder import OpenStep
from ddpdoctor.runtime.torch_compat import (
    compiled_autograd_asked,
    compiled_autograd_enabled,
    compiled_autograd_possible,
)

#: ``0`` (or ``off``/``false``/``no``) forces the Python comm hook.
ENV = environment.NATIVE_ENV
#: Test-only: ``compile`` builds a source that does not compile (the fallback path).
FAULT_ENV = native_cache.FAULT_ENV
#: Ring entries: a step drains it, so this only has to exceed the buckets of one step; a rank
#: that stops draining (closed monitor) overwrites the oldest and memory stays at ~48 bytes each.
RING_CAPACITY = 4096
#: Give up on a build (compiler stuck, a stale build lock) after this long.
BUILD_TIMEOUT_S = 600.0
#: Output tensors hooked at most per forward under compiled autograd (the first ones found,
#: depth first).
OUTPUT_LIMIT = 8
#: ``torch._dynamo.config.compiled_autograd`` is read every this many synchronizing forwards (and
#: at the first). Torch itself reads it only when a function is compiled, programs set it at their
#: start, and a read walks torch's config module: per step it was most of this side's forward
#: cost. Whether compiled autograd is on is read at every forward.
CONFIG_EVERY = 16
_perf_ns = time.perf_counter_ns  # one lookup less per call on the hot path


class NativeUnavailable(SetupError, RuntimeError):
    """The native hook cannot be built or loaded here (the message says why)."""


def enabled_by_env() -> bool:
    """False when ``DDPDOCTOR_NATIVE`` turns the native hook off."""
    return not environment.turned_off(ENV)


def _source_text() -> str:
    return native_cache.source_text()


def _torch_tag() -> str:
    return native_cache.torch_tag(torch.__version__, getattr(torch.version, "git_version", None))


def extension_name(text: str | None = None) -> str:
    """The extension's name: torch version and source hash (``native_cache.extension_name``)."""
    return native_cache.extension_name(text if text is not None else _source_text(), _torch_tag())


def build_directory(name: str) -> Path:
    """Where ``name`` is built and cached: under torch's default extension directory
    (``get_default_build_root``: ``$XDG_CACHE_HOME`` or ``~/.cache``, then ``torch_extensions``)."""
    return Path(torch_compat.extensions_root()) / name


_built = native_cache.built


def _tool_path() -> str:
    """PATH for the build: this interpreter's scripts directory first (a pip-installed ``ninja``
    lives there, and torch looks ninja up on PATH)."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja

        dirs.insert(0, str(ninja.BIN_DIR))
    except Exception:  # noqa: BLE001, S110 - the ninja package is optional: a system ninja serves as well
        pass
    return os.pathsep.join([*dirs, os.environ.get("PATH", "")])


def _build_here(name: str, directory: Path, text: str, verbose: bool = False) -> None:
    """Build (or reuse) the extension in this process (the child of ``build``)."""
    import fcntl

    from torch.utils.cpp_extension import load_inline

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "ddpdoctor.lock", "w") as lock:
        # Builders take this lock first: the kernel releases it when a builder dies, so ranks
        # that start together wait for one build, and torch's own lock file, which a killed
        # build leaves behind (torch then waits for ever), is known to be stale here.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(directory, name) is not None:
            return
        (directory / "lock").unlink(missing_ok=True)
        load_inline(
            name=name,
            cpp_sources=[text],
            build_directory=str(directory),
            extra_cflags=list(native_cache.CFLAGS),
            verbose=verbose,
        )
        tmp = directory / f"{native_cache.OK_MARK}.{os.getpid()}"
        tmp.write_text(f"{name}\n")
        tmp.replace(directory / native_cache.OK_MARK)


def build(timeout: float = BUILD_TIMEOUT_S, verbose: bool = False) -> Path:
    """Build the extension unless it is cached; return its shared object.

    The compiler runs in a child process under torch's build lock (ranks that build at once
    wait for one another). Raises ``NativeUnavailable`` with the build's last output lines.
    """
    text = _source_text()
    name = extension_name(text)
    directory = build_directory(name)
    so = _built(directory, name)
    if so is not None:
        return so
    # the child imports this very ddpdoctor, wherever the parent found it
    package_root = str(Path(__file__).resolve().parents[3])
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PATH=_tool_path(), PYTHONPATH=python_path)
    code = (
        "import sys; from pathlib import Path; from ddpdoctor.runtime.step import native_hook as n; "
        "n._build_here(sys.argv[1], Path(sys.argv[2]), sys.stdin.read(), sys.argv[3] == '1')"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, name, str(directory), "1" if verbose else "0"],
            input=text,
            capture_output=not verbose,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise NativeUnavailable(f"the build did not finish in {timeout:.0f} s") from None
    except OSError as exc:
        raise NativeUnavailable(f"cannot start the build: {exc}") from None
    so = _built(directory, name)
    if proc.returncode != 0 or so is None:
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        raise NativeUnavailable(f"the build failed (exit {proc.returncode}): {tail or 'no output'}")
    return so


def _import(name: str, so: Path) -> ModuleType:
    # (torch is imported: the extension's symbols resolve against its libraries)
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise NativeUnavailable(f"cannot load {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    column = getattr(module, "Column", None)
    if column is not None:  # (a step record's bucket column reads as a list: a Sequence)
        collections.abc.Sequence.register(column)
    return module


_lock = threading.Lock()
_module: ModuleType | None = None
_problem: str | None = None
_warned = False
#: Seconds the last ``load`` took (build included when it built), for the benches.
load_seconds: float | None = None


def load() -> ModuleType:
    """The extension module, built if needed, once per process; ``NativeUnavailable`` if not."""
    global _module, _problem, load_seconds
    with _lock:
        if _module is not None:
            return _module
        if _problem is not None:
            raise NativeUnavailable(_problem)
        t = time.perf_counter()
        try:
            so = build()
            _module = _import(so.stem, so)
        except Exception as exc:  # any build or load failure means the Python route; kept as the reason
            _problem = str(exc) if isinstance(exc, NativeUnavailable) else f"{type(exc).__name__}: {exc}"
            raise NativeUnavailable(_problem) from exc
        finally:
            load_seconds = time.perf_counter() - t
        return _module


def reset() -> None:
    """Forget the loaded module and any failure (tests)."""
    global _module, _problem, _warned
    with _lock:
        _module, _problem, _warned = None, None, False


def choose_failed(why: str) -> None:
    """Say once per process that the Python route times the buckets, and why."""
    global _warned
    with _lock:
        first = not _warned
        _warned = True
    if first:
        warn(
            f"ddpdoctor: the native comm hook is unavailable ({why}); per-bucket timing uses the Python "
            f"comm hook (costs more on short steps; {ENV}=0 skips the build). Training is not affected.",
            CommHookWarning,
            stacklevel=5,
        )


def choose(cuda: bool) -> ModuleType | None:
    """The extension when the native hook should time this model, else None (Python route).

    CUDA models keep the Python route, whose marks are CUDA events on the gradient's stream. A
    build or load failure is said once per process (``CommHookWarning``).
    """
    if cuda or not enabled_by_env():
        return None
    try:
        return load()
    except NativeUnavailable as exc:
        choose_failed(str(exc))
        return None


def ddp_scale(module: ModuleType, ddp: Any) -> Any:
    """The extension's ``DdpScale`` for ``ddp``: scales a bucket exactly as DDP's reducer scales
    its gradients when no hook is registered (``comm_hook.MeanState`` says how). Under
    ``gradient_as_bucket_view`` it puts a C++ pre-hook on each reduced parameter's gradient
    accumulator, for as long as the scale lives (which DDP's reducer or hook state holds): DDP
    divides a gradient in place when the backward accumulated into its bucket view, and that can
    only be seen before the accumulation. A divide and a multiply by the reciprocal differ only for
    a divisor that is not a power of two, which DDP's divisor (the world size, or under ``Join``
    the ranks still training) can be from a world size of 3: below it nothing is watched. The
    watch costs the backward 0.25-0.5 µs a parameter on the 2-core VM (BENCHMARKS.md)."""
    size = ddp.process_group.size()
    watch = size >= 3 and bool(getattr(ddp, "gradient_as_bucket_view", False))
    params = [p for p in ddp.module.parameters() if p.requires_grad] if watch else []
    return module.DdpScale(ddp.reducer, size, params, watch)


def views_divided_inexactly(ddp: Any) -> bool:
    """Whether DDP may divide gradients that stay their bucket views (``gradient_as_bucket_view``)
    by a world size that is not a power of two, which a multiply by its reciprocal does not match
    to the bit: where only ``DdpScale``'s watch gives DDP's bits."""
    size = ddp.process_group.size()
    return bool(getattr(ddp, "gradient_as_bucket_view", False)) and size & (size - 1) != 0


def python_route_scale(ddp: Any, cuda: bool) -> Any | None:
    """The Python route's ``DdpScale`` (``ddp_scale``), or None where the extension is not loaded.

    On CPU the Python route runs where the native one could not (its failure is said already) or
    for a hook registered before ``instrument``: the extension is loaded as for the native route.
    A GPU host builds nothing for a job that has no use for it (``run_cmd.prepare_native``): a
    GPU model takes a cached build, and builds one only where DDP's bits need it (the gradients
    may stay their bucket views at a world size that is not a power of two).
    """
    if not enabled_by_env():
        return None
    if cuda and native_cache.cached_build() is None and not views_divided_inexactly(ddp):
        return None
    try:
        return ddp_scale(load(), ddp)
    except Exception:  # noqa: BLE001 - no extension: the world size's reciprocal, as before (MeanState)
        return None


def _output_tensors(output: Any, limit: int = OUTPUT_LIMIT) -> list[Any]:
    """The tensors requiring grad in a forward's output (nested tuples, lists, dicts), at most ``limit``."""
    found: list[Any] = []
    stack = [output]
    while stack and len(found) < limit:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found


class NativeTiming:
    """The native hook of one DDP instance: its registration, and the per-step Python side."""

    def __init__(self, module: ModuleType, ddp: Any, monitor: Any) -> None:
        self._module = module
        #: the hooks this side reports to (``StepHooks``: recorder, probes, own_ns), held weakly
        self.owner = weakref.ref(monitor)
        self.ring: Any = None
        #: the ``DdpScale`` the hook scales with (its non-finite check is watched through it)
        self.scale: Any = None
        #: what the ``DdpScale`` the hook scales with can do: (read DDP's divisor, watch the
        #: gradients); the reducer's hook holds the scale itself
        self.exact: tuple[bool, bool] = (False, False)
        #: the ring's ``drain_into``, read once (a plain C function bound to the ring: the call
        #: of every step, made when caches are cold)
        self.drain_into: Any = None
        #: the routine forward's change of step in one C call (the extension's ``step_changer``:
        #: the ring's marks packed into the step, the optimizer's stamps, the step ended and the
        #: next opened), bound by ``bind_step_change`` once the monitor has what it needs
        self.step_change: Any = None
        # bucket parameters come back as TensorImpl addresses (Tensor._cdata)
        self._names = {p._cdata: (n, str(p.dtype).removeprefix("torch.")) for n, p in ddp.module.named_parameters()}
        self._want_layout = False
        self._queued: Any = None  # the step whose backward callbacks are queued (leaf outputs)
        self._leaf_hooks: list[Any] = []  # hooks on leaf outputs, removed at the next forward
        #: a backward was armed and the ring not drained since: the monitor's next hook of the step
        #: (next forward, close) drains it into the open step (``StepHooks.drain_native``)
        self.pending = False
        self.delegated = False
        self._asked = False  # torch._dynamo.config.compiled_autograd, as last read
        #: synchronizing forwards until the config is read again (``StepHooks.on_forward_pre``'s
        #: routine branch counts it down as ``on_sync_forward`` does)
        self.asked_in = 0
        #: the backward's end stamped from Python (compiled autograd may trace it): the monitor's
        #: forward post-hook hooks the output (``arm_python``)
        self.python_end = False
        #: the last synchronizing forward asked nothing of this side but its stamps (no layout,
        #: the backward's end stamped in C++, no hook on an output): the monitor's next forward
        #: may take its routine path (in ``StepHooks.on_forward_pre``)
        self.routine = False

    @property
    def registered(self) -> bool:
        return self.ring is not None

    def check(self, ddp: Any) -> None:
        """Raise unless the extension takes this DDP's reducer and process group (changes nothing)."""
        if not self._module.accepts(ddp.reducer, ddp.process_group):
            raise NativeUnavailable("no reducer or process group")

    def register(self, ddp: Any) -> None:
        """Put the hook on DDP's reducer (for good: a reducer takes one hook)."""
        scale = ddp_scale(self._module, ddp)
        self.ring = self._module.register_timed_hook(ddp.reducer, ddp.process_group, RING_CAPACITY, scale)
        self.scale = scale
        self.exact = (bool(scale.reads_divisor), bool(scale.watches))
        self.drain_into = self.ring.drain_into
        self.step_change = None
        self.delegated = False

    def delegate(self, state: Any, hook: Any) -> None:
        """A user hook registered after this one: hand it every bucket, through ``hook(state,
        bucket)`` (ddpdoctor's Python comm hook, which times it). From then on the Python route
        times the buckets and this side does nothing per step (the stamps of a backward not
        drained yet go into the open step first)."""
        monitor = self.owner()
        if self.pending and monitor is not None:
            self.drain(monitor.recorder.current)
        self.ring.delegate(state, hook)
        self.delegated = True
        self.routine = False

    def stop(self) -> None:
        """Detached: the hook keeps all-reducing and stamps nothing."""
        self.routine = False
        self._drop_leaf_hooks()
        if self.ring is not None:
            self.ring.set_enabled(False)

    def _drop_leaf_hooks(self) -> None:
        hooks, self._leaf_hooks = self._leaf_hooks, []
        for handle in hooks:
            handle.remove()

    # -- per step (training thread) ------------------------------------------------------

    def on_sync_forward(self, step: Any, monitor: Any) -> None:
        """A synchronizing training forward begins (``step``, open): its backward's stamps are
        drained at the monitor's next forward; the layout asked for where the step wants it.
        ``StepHooks.on_forward_pre``'s routine branch runs what this does when nothing changed
        (``asked_in`` counted down, ``pending`` set): a change here is made there too."""
        ring = self.ring
        if ring is None or self.delegated:
            return
        on = monitor.probes.on
        if not on["buckets"]:
            return
        try:
            want = step.layout is not None and on["layout"]
            if want != self._want_layout:
                ring.want_layout(want)
                self._want_layout = want
            if on["backward_end"]:
                if self._leaf_hooks:
                    self._drop_leaf_hooks()
                # compiled autograd may trace the graph: the backward's end is then stamped from
                # Python (it takes Python hooks and callbacks), not by the hook's C++ callback
                self.asked_in -= 1
                if self.asked_in <= 0:
                    self._asked, self.asked_in = compiled_autograd_asked(), CONFIG_EVERY
                python_end = self._asked or compiled_autograd_enabled()
                if python_end != self.python_end:
                    ring.stamp_ends(not python_end)
                    self.python_end = python_end
            # DDP all-reduces after any forward with grad enabled outside no_sync, in eval mode
            # too (a model trained with model.eval() to freeze BatchNorm)
            self.pending = True
            self.routine = not want and not self.python_end and not self._leaf_hooks and on["backward_end"]
        except Exception as exc:  # noqa: BLE001 - runs in DDP's forward: a failing probe is switched off, never breaks training
            monitor.probes.failed("buckets", exc)

    def routine_config(self) -> bool:
        """``on_sync_forward``'s read of compiled autograd's config (every ``CONFIG_EVERY``
        forwards), for the routine forward: True where it still asks for nothing (the routine
        forward goes on, counting this forward), False where it asks (nothing changed here: the
        full path reads it again and stamps the backward's end from Python)."""
        if compiled_autograd_asked():
            return False
        self._asked, self.asked_in = False, CONFIG_EVERY + 1
        return True

    def bind_step_change(self, stamps: Any) -> bool:
        """Bind ``step_change`` to this ring and the monitor's optimizer stamps, its new steps
        ``OpenStep``s; whether it is bound (an extension without it, or an OpenStep or stamps it
        refuses: the routine forward stays off)."""
        changer = getattr(self._module, "step_changer", None)
        if self.step_change is None and changer is not None and self.ring is not None:
            try:
                self.step_change = changer(self.ring, stamps, OpenStep)
            except TypeError:
                self.step_change = None
        return self.step_change is not None

    def compiled_possible(self) -> bool:
        """``torch_compat.compiled_autograd_possible`` for the sampled checks (their C++ arrival
        hooks), from what this side knows already where it can: on its routine path the config
        asked for nothing when read at most ``CONFIG_EVERY`` forwards ago (the same answer the
        backward's C++ end stamp relies on), and only the module's switch is read. The config
        module's walk took tens of µs a sample with cold caches."""
        if self.routine and self.asked_in > 0 and self.ring is not None and not self.delegated:
            return compiled_autograd_enabled()
        return compiled_autograd_possible()

    def arm_python(self, step: Any, output: Any, monitor: Any) -> None:
        """After a synchronizing forward that compiled autograd may trace (``python_end``): the
        backward's start and end from Python hooks on the output (a node pre-hook, or a tensor
        hook on a leaf: a parameter returned as it is), then a final callback
        (``on_output_grad``, ``on_backward_end``). A hook on a leaf outlives the graph: it is
        removed at the next forward (kept, hooks would pile up and fire for old steps)."""
        if step is None or self.ring is None or self.delegated or not monitor.probes.on["backward_end"]:
            return
        try:
            tensors = _output_tensors(output)
            if not tensors:
                return
            hook = _OutputGradHook(weakref.ref(self), step)
            for tensor in tensors:
                if tensor.grad_fn is not None:
                    tensor.grad_fn.register_prehook(hook)
            self._leaf_hooks = [tensor.register_hook(hook) for tensor in tensors if tensor.grad_fn is None]
        except Exception as exc:  # noqa: BLE001 - runs in DDP's forward: a failing probe is switched off, never breaks training
            monitor.probes.failed("backward_end", exc)

    def on_output_grad(self, step: Any) -> None:
        """First thing in backward: queue the backward-end callback (once per step)."""
        if self._queued is step:
            return
        self._queued = step
        this = weakref.ref(self)
        torch_compat.queue_backward_callback(lambda: _call(this, "on_backward_end", step))

    def on_backward_end(self, step: Any) -> None:
        """The graph is done (DDP's finalization not yet run): stamp it (the ring is drained at
        the monitor's next hook, as on the C++ path)."""
        monitor = self.owner()
        if monitor is None or monitor.closed:
            return
        try:
            monitor.recorder.backward_end(step)
        except Exception as exc:  # noqa: BLE001 - it would surface inside loss.backward(); never breaks training
            monitor.probes.failed("backward_end", exc)

    def in_flight(self) -> list[tuple[int, int, int, int, int]]:
        """The stamps of the buckets not drained yet, left in the ring (any thread; read only).

        The hang watchdog reads them when it reports a stall: while DDP's finalization waits for
        the all-reduces, they say which bucket is pending. Read then, not at every backward end,
        they cost nothing per step and change nothing the watchdog's progress signature sees."""
        if self.ring is None or self.delegated:
            return []
        return _shifted(self.ring.peek())

    def backward_ended(self) -> bool:
        """Whether the armed backward's compute end is stamped but not drained yet (any thread;
        read only): the rank then waits in DDP's finalization, for the all-reduces."""
        if self.ring is None or self.delegated:
            return False
        return bool(self.ring.backward_end())

    def drain(self, step: Any) -> None:
        """Move the ring's stamps, and the backward end stamped in C++, into ``step`` (the step
        whose backward ran them: the open one, at the monitor's next hook after the backward)."""
        monitor = self.owner()
        ring = self.ring
        if ring is None or monitor is None:  # (closing: the monitor drains before its last step)
            return
        t = _perf_ns()
        try:
            on = monitor.probes.on
            if (
                not self._want_layout
                and step is not None
                and step.synced_forward
                and on["buckets"]
                and on["backward_end"]
            ):
                # the common case in one call: C++ sets the step's lists and backward end (None
                # back), or hands the columns over (out of order)
                columns = self.drain_into(step, clocks.OFFSET_NS)
            else:
                columns = ring.drain_columns(clocks.OFFSET_NS)
            self.pending = False
            if columns is not None:
                self._apply_columns(monitor, step, columns)
        except Exception as exc:  # noqa: BLE001 - inside loss.backward() or forward: never breaks training
            monitor.probes.failed("buckets", exc)
        finally:
            monitor.own_ns += _perf_ns() - t

    def apply_columns(self, monitor: Any, step: Any, columns: tuple[Any, ...]) -> None:
        """The ring's columns (``drain_columns``, or ``drain_into`` out of order) into ``step``."""
        try:
            self._apply_columns(monitor, step, columns)
        except Exception as exc:  # noqa: BLE001 - inside forward: never breaks training
            monitor.probes.failed("buckets", exc)

    def _apply_columns(self, monitor: Any, step: Any, columns: tuple[Any, ...]) -> None:
        indices, ready, launch, done, nbytes, in_order, backward_end = columns
        on = monitor.probes.on
        # the parameter lists go with the marks, whether used or not: nothing accumulates
        layout = self.ring.take_layout() if self._want_layout else None
        if step is None or not step.synced_forward:
            return
        if backward_end is not None and on["backward_end"]:
            monitor.recorder.backward_end(step, backward_end)
        if not indices or not on["buckets"]:
            return
        monitor.recorder.add_bucket_columns(step, indices, ready, launch, done, nbytes, in_order)
        if layout and step.layout is not None:
            self._layout(monitor, step, dict(zip(indices, nbytes, strict=True)), layout)

    def _layout(
        self,
        monitor: Any,
        step: Any,
        nbytes: dict[int, int],
        layout: list[tuple[int, list[int]]],
    ) -> None:
        from ddpdoctor.events import BucketInfo

        for index, params in layout:
            named = [self._names.get(p, ("?", "")) for p in params]
            dtype = next((d for _, d in named if d), "")
            info = BucketInfo(index=index, params=[n for n, _ in named], bytes=nbytes.get(index, 0), dtype=dtype)
            monitor.recorder.bucket_layout(step, index, info)


def _shifted(marks: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """The marks on the host clock ddpdoctor uses (the tests' clock offset, when it is set)."""
    off = clocks.OFFSET_NS
    if not off:
        return marks
    return [(i, r + off, la + off, d + off if d else 0, b) for i, r, la, d, b in marks]


class _OutputGradHook:
    """A gradient hook on the forward's output: returns None, so the gradient is unchanged."""

    __slots__ = ("timing", "step")

    def __init__(self, timing: weakref.ref[NativeTiming], step: Any) -> None:
        self.timing = timing
        self.step = step

    def __call__(self, grad: Any) -> None:  # grad: the output's gradient(s); left unchanged
        timing = self.timing()
        if timing is None:
            return
        monitor = timing.owner()
        if monitor is None or monitor.closed:
            return
        try:
            timing.on_output_grad(self.step)
        except Exception as exc:  # noqa: BLE001 - runs in loss.backward(): a failing probe is switched off, never breaks training
            monitor.probes.failed("backward_end", exc)


def _call(ref: weakref.ref[NativeTiming], method: str, step: Any) -> None:
    timing = ref()
    if timing is not None:
        getattr(timing, method)(step)


def main(argv: list[str] | None = None) -> int:
    """``python -m ddpdoctor.runtime.native [--verbose]``: build (or find) the extension, print
    where it is and how long building and loading took; exit 1 when it cannot be built."""
    args = sys.argv[1:] if argv is None else argv
    if not enabled_by_env():
        print(f"ddpdoctor: native comm hook off ({ENV}=0)")
        return 0
    t = time.perf_counter()
    try:
        so = build(verbose="--verbose" in args)
        built = time.perf_counter() - t
        t = time.perf_counter()
        module = _import(so.stem, so)
        loaded = time.perf_counter() - t
    except Exception as exc:  # noqa: BLE001 - reported to the caller as the reason the Python route is used
        print(f"ddpdoctor: native comm hook unavailable: {exc}", file=sys.stderr)
        return 1
    print(
        f"ddpdoctor: native comm hook {module.__name__}: build/check {built:.2f} s, load {loaded * 1000:.1f} ms ({so})"
    )
    return 0
