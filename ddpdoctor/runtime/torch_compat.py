"""Every private torch API ddpdoctor uses, reached through one place and probed once.

torch's DDP internals move between releases (``broadcast_buffers`` became ``forward_sync_buffers``
in 2.13; private helpers change signatures). Each feature that needs a private API has a probe,
run once per process on the installed torch. A failed probe turns that feature off, with one
warning naming the torch version and what is missing; training is never touched, since every
use site asks ``available(feature)`` before it changes anything.

Features and what they need:

- ``comm_hook``: ``dist._register_comm_hook`` and ``GradBucket`` (per-bucket timing);
- ``reducer_rebuild``: DDP's ``_build_params_for_reducer``, ``_build_debug_param_to_name_mapping``,
  ``_ddp_init_helper(parameters, expect_sparse_gradient, param_to_name_mapping, static_graph)``
  and ``Reducer._remove_autograd_hooks`` (timing a comm hook registered before ``instrument``);
- ``buffer_timing``: DDP's ``_sync_buffers`` method (buffer broadcast timed apart from forward);
- ``post_forward_timing``: DDP's ``_post_forward`` (the cost of ``find_unused_parameters``);
- ``backward_end``: autograd's ``queue_callback`` (the end of backward compute);
- ``logging_data``: DDP's ``_get_ddp_logging_data`` (bucket layout, a hook's name);
- ``grad_ready``: ``Tensor.register_post_accumulate_grad_hook`` (unused parameters);
- ``default_store``: ``distributed_c10d._get_default_store`` (agreeing on a run dir).
"""

from __future__ import annotations

import contextvars
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddpdoctor.categories import ProbeDisabledWarning
from ddpdoctor.categories import warn as warn_safely

TORCH_VERSION = str(torch.__version__).split("+")[0]

_INIT_HELPER_PARAMS = ["parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"]


def _need(owner: Any, *names: str) -> None:
    for name in names:
        if not callable(getattr(owner, name, None)):
            raise AttributeError(f"{getattr(owner, '__name__', owner)}.{name} is missing")


def _probe_comm_hook() -> None:
    _need(dist, "_register_comm_hook")
    _need(dist.GradBucket, "index", "buffer", "parameters")


def _probe_reducer_rebuild() -> None:
    _need(
        TorchDDP,
        "_build_params_for_reducer",
        "_build_debug_param_to_name_mapping",
        "_ddp_init_helper",
        "_remove_autograd_hooks",
    )
    _need(dist.Reducer, "_remove_autograd_hooks")
    params = list(inspect.signature(TorchDDP._ddp_init_helper).parameters)[1:]
    if params != _INIT_HELPER_PARAMS:
        raise TypeError(f"DDP._ddp_init_helper takes ({', '.join(params)}), not ({', '.join(_INIT_HELPER_PARAMS)})")


def _probe_buffer_timing() -> None:
    _need(TorchDDP, "_sync_buffers")


def _probe_post_forward() -> None:
    _need(TorchDDP, "_post_forward")


def _probe_backward_end() -> None:
    _need(torch.autograd.Variable._execution_engine, "queue_callback")


def _probe_logging_data() -> None:
    _need(TorchDDP, "_get_ddp_logging_data")


def _probe_grad_ready() -> None:
    _need(torch.Tensor, "register_post_accumulate_grad_hook")


def _probe_used_map() -> None:
    _need(dist.Reducer, "_get_local_used_map")


def _probe_default_store() -> None:
    _need(dist.distributed_c10d, "_get_default_store")


PROBES: dict[str, tuple[Callable[[], None], str]] = {
    "comm_hook": (_probe_comm_hook, "per-bucket timing"),
    "reducer_rebuild": (_probe_reducer_rebuild, "timing a comm hook registered before instrument"),
    "buffer_timing": (_probe_buffer_timing, "buffer broadcast timing"),
    "post_forward_timing": (_probe_post_forward, "the cost of find_unused_parameters"),
    "backward_end": (_probe_backward_end, "the end of backward compute"),
    "logging_data": (_probe_logging_data, "DDP's logging data (bucket layout, hook names)"),
    "grad_ready": (_probe_grad_ready, "unused-parameter checks"),
    "default_store": (_probe_default_store, "a run dir agreed through the rendezvous store"),
    "used_map": (_probe_used_map, "find_unused_parameters checked at every step, not only sampled ones"),
}

_results: dict[str, str | None] = {}  # feature -> None (works) or why not
_warned: set[str] = set()
_lock = threading.Lock()


def problem(feature: str) -> str | None:
    """Why ``feature`` is off on this torch (None: it works). Probed once per process."""
    with _lock:
        if feature not in _results:
            probe, _ = PROBES[feature]
            try:
                probe()
                _results[feature] = None
            except Exception as exc:  # noqa: BLE001 - any failure of a feature probe means the feature is off; kept as the reason
                _results[feature] = f"{type(exc).__name__}: {exc}"
        return _results[feature]


def available(feature: str, warn: bool = True) -> bool:
    """Whether ``feature`` works on this torch; the first time it does not, warn (once)."""
    why = problem(feature)
    if why is None:
        return True
    if warn:
        with _lock:
            first = feature not in _warned
            _warned.add(feature)
        if first:
            warn_safely(
                f"ddpdoctor: {PROBES[feature][1]} is off on torch {TORCH_VERSION}: {why}. Training is not affected.",
                ProbeDisabledWarning,
                stacklevel=3,
            )
    return False


def report() -> dict[str, str | None]:
    """Every feature's probe result (for diagnostics and tests)."""
    return {feature: problem(feature) for feature in PROBES}


# -- DDP options that changed names --------------------------------------------------------


def buffer_sync(ddp: Any) -> bool:
    """Whether DDP syncs buffers at every forward (``forward_sync_buffers`` from torch 2.13,
    ``broadcast_buffers`` before; 2.13 keeps the old name as a property)."""
    value = ddp.__dict__.get("forward_sync_buffers")
    if value is None:
        value = getattr(ddp, "forward_sync_buffers", None)
    if value is None:
        value = getattr(ddp, "broadcast_buffers", True)
    return bool(value)


def first_bucket_bytes_cap(ddp: Any) -> int | None:
    """The first bucket's byte cap: from the bucket config (torch 2.13+), else as torch 2.5 to 2.12
    compute it (``dist._DEFAULT_FIRST_BUCKET_BYTES`` when ``bucket_cap_mb`` was left at its
    default, else ``bucket_bytes_cap``); None where neither can be read."""
    config = getattr(ddp, "_bucket_config", None)
    if config is not None and getattr(config, "first_bucket_bytes_cap", None) is not None:
        return int(config.first_bucket_bytes_cap)
    cap = getattr(ddp, "bucket_bytes_cap", None)
    default = getattr(ddp, "bucket_bytes_cap_default", None)
    if cap is None or default is None:
        return None
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None) if default else cap
    return int(first) if first is not None else None


def constructor_accepts(name: str) -> bool:
    """Whether DDP's constructor takes the keyword ``name`` on this torch."""
    return name in inspect.signature(TorchDDP.__init__).parameters


def buffer_sync_kwargs(enabled: bool) -> dict[str, bool]:
    """Constructor keywords for buffer sync ``enabled``, in this torch's spelling.

    ``broadcast_buffers=False`` also skips the buffer sync at construction (rank-local buffers
    stay rank-local); ``forward_sync_buffers=False`` (2.13+) does not. So ``False`` is always
    spelled ``broadcast_buffers``, which every supported torch accepts.
    """
    if enabled and constructor_accepts("forward_sync_buffers"):
        return {"forward_sync_buffers": True}
    return {"broadcast_buffers": enabled}


# -- private calls, each behind its feature -----------------------------------------------

_TLS_CONTEXT = "context"
_tls_context_ok: bool | None = None


def _probe_tls_context() -> bool:
    global _tls_context_ok
    names = ("_is_key_in_tls", "_get_obj_in_tls", "_stash_obj_in_tls", "_remove_obj_from_tls")
    _tls_context_ok = all(callable(getattr(torch._C, n, None)) for n in names)
    return _tls_context_ok


def without_backward_context(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the Python ``contextvars.Context`` that torch (2.13+) stashes in the
    thread-local state for the length of a backward taken out for the call, then put back.

    Why: a gloo work or a future callback made during backward copies the thread-local state,
    that Context included. When a gloo worker thread drops the last reference to it while the
    interpreter is finalizing, releasing the Context needs the GIL, the thread is made to exit,
    and the process dies by ``std::terminate`` (SIGABRT). The all-reduces and callbacks
    ddpdoctor's comm hook makes hold no Python context that way. Where torch stashes none
    (2.12 and older) this is a plain call.
    """
    ok = _tls_context_ok if _tls_context_ok is not None else _probe_tls_context()
    if not ok or not torch._C._is_key_in_tls(_TLS_CONTEXT):
        return fn(*args)
    saved = torch._C._get_obj_in_tls(_TLS_CONTEXT)
    torch._C._remove_obj_from_tls(_TLS_CONTEXT)
    try:
        return fn(*args)
    finally:
        torch._C._stash_obj_in_tls(_TLS_CONTEXT, saved)


def logging_data(ddp: Any) -> dict[str, Any]:
    """DDP's logging data, or {} where torch has none."""
    if not available("logging_data", warn=False):
        return {}
    return dict(ddp._get_ddp_logging_data())


def default_store() -> Any:
    """The default process group's store, or None."""
    if not available("default_store", warn=False):
        return None
    return dist.distributed_c10d._get_default_store()


def register_comm_hook(reducer: Any, state: object, hook: Callable[..., Any]) -> None:
    dist._register_comm_hook(reducer, state, hook)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def remove_reducer_hooks(reducer: Any) -> None:
    reducer._remove_autograd_hooks()


def build_reducer(ddp: Any) -> None:
    """Build a fresh reducer over ``ddp``'s parameters, as DDP's own ``__setstate__`` does.

    The old reducer keeps its autograd hooks (the caller removes them once the new one is in
    place), so a failure here leaves the old one working.
    """
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    mapping = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, mapping, ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    ddp._has_rebuilt_buckets = False


def reducer_parameter_count(ddp: Any) -> tuple[int | None, int]:
    """(parameters the reducer was built with, parameters a new one would take)."""
    old = logging_data(ddp).get("num_parameter_tensors")
    parameters, _ = ddp._build_params_for_reducer()
    return (int(old) if old is not None else None), len(parameters)


def extensions_root() -> str:
    """torch's cache of built extensions (``cpp_extension.get_default_build_root``), read without
    importing ``torch.utils.cpp_extension`` in the training process: that import brings in
    setuptools and distutils, and on a CUDA build without a CUDA runtime it warns on every
    rank's stderr. The build itself imports it, in a child process."""
    try:
        from torch import _appdirs

        return os.path.realpath(str(_appdirs.user_cache_dir(appname="torch_extensions")))
    except Exception:  # noqa: BLE001 - another torch's layout: torch's own function, with its import
        from torch.utils.cpp_extension import get_default_build_root

        return str(get_default_build_root())


# -- compiled autograd: it traces the hooks of a graph and knows Python hooks, not C++ ones ------


#: where compiled autograd's switch lives (the routine forward reads it without a call)
COMPILED_AUTOGRAD_MODULE = "torch._dynamo.compiled_autograd"


def compiled_autograd_enabled() -> bool:
    """Whether compiled autograd is on now (``compiled_autograd.enable``, or a compiled function
    asked for it running): it compiles the hooks of the graph it traces and knows Python hooks,
    not a C++ one of ours. Read from ``sys.modules``: a process that never loaded dynamo cannot
    have it on."""
    compiled = sys.modules.get(COMPILED_AUTOGRAD_MODULE)
    return compiled is not None and bool(getattr(compiled, "compiled_autograd_enabled", False))


#: where compiled autograd is asked for (``compiled_autograd_asked``)
DYNAMO_CONFIG_MODULE = "torch._dynamo.config"


class _ConfigFlag:
    """One flag of a torch config module, read in full only when the user's setting of it may
    have moved.

    ``ConfigModule.__getattr__`` (torch 2.6 and later) walks several calls a read: 13 µs with
    cold caches here, 30 µs in place between training steps. What a read returns changes only
    when the user sets the flag (``config.x = v``, ``config.patch``): that stores the value in the
    entry's ``user_override`` (a ``ContextVar`` from 2.13 on, an attribute before), whose current
    object is compared here by identity. The rest of the value (environment, default) is fixed
    at import; an aliased flag (read from another module) is always read in full, as is every
    torch whose entries are laid out otherwise (2.5 keeps plain values: its read is a lookup)."""

    __slots__ = ("module", "name", "_entry", "_var", "_seen", "_value")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name
        self._entry: Any = None  # the config entry whose override is watched (None: read in full)
        self._var: Any = None  # its ContextVar (None: the override is an attribute)
        self._seen: Any = self  # the override's object at the last full read (self: none yet)
        self._value = False

    def bind(self, config: Any) -> None:
        entry = getattr(config, "_config", {}).get(self.name)
        override = getattr(entry, "user_override", None)
        if entry is None or override is None or getattr(entry, "alias", None) is not None:
            return
        self._entry = entry
        self._var = override if isinstance(override, contextvars.ContextVar) else None

    def __call__(self) -> bool:
        config = sys.modules.get(self.module)
        if config is None:
            return False
        entry = self._entry
        if entry is None:
            if self._seen is not self:  # bound before, and nothing to watch: a full read each time
                return bool(getattr(config, self.name, False))
            self._seen = None
            self.bind(config)
            entry = self._entry
            if entry is None:
                return bool(getattr(config, self.name, False))
        var = self._var
        current = var.get() if var is not None else entry.user_override
        if current is not self._seen:
            self._value = bool(getattr(config, self.name, False))
            self._seen = current
        return self._value


#: Whether ``torch._dynamo.config.compiled_autograd`` asks for compiled autograd: a function
#: compiled then may run this backward under it. The native timing reads it every few forwards, a
#: sample once; a full read of torch's config module only after the user set it (``_ConfigFlag``).
compiled_autograd_asked = _ConfigFlag(DYNAMO_CONFIG_MODULE, "compiled_autograd")


def compiled_autograd_possible() -> bool:
    """Whether a backward run now may be traced by compiled autograd (C++ hooks must then stay
    off the graph: Python hooks are used instead)."""
    return compiled_autograd_asked() or compiled_autograd_enabled()


# -- torch.compile: dynamo must run ddpdoctor's hooks as they are, not trace them ----------------

_DYNAMO_RULES = "torch._dynamo.trace_rules"
_dynamo_skip_lock = threading.Lock()
_dynamo_skip_state = ""  # "" not yet; "waiting" for dynamo's import; "done"; "failed"


def _skip_ddpdoctor_in_dynamo(rules: Any) -> None:
    global _dynamo_skip_state
    try:
        rules.add(__name__.split(".")[0])
        _dynamo_skip_state = "done"
    except Exception:  # noqa: BLE001 - a torch without this rule: dynamo traces the hooks, which still work
        _dynamo_skip_state = "failed"


class _AfterDynamoRules(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when dynamo's trace rules are imported, it hands their spec over
    with a loader that adds ddpdoctor's skip once the module has run (and then leaves
    ``sys.meta_path``: not from ``find_spec``, while the import system walks that list)."""

    def __init__(self) -> None:
        self._busy = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO_RULES or self._busy:
            return None
        self._busy = True  # the search below walks sys.meta_path again, this finder included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _skip_ddpdoctor_in_dynamo(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def skip_in_dynamo() -> None:
    """Tell ``torch.compile`` to run ddpdoctor's code as it is: a compiled DDP (``torch.compile``
    over the DDP model) then calls the monitor's forward hooks without tracing them, as it calls
    any function of a skipped module, instead of compiling them into its graphs (which broke
    them into many frames, recompiled as the monitor's state changed, and warned about the
    clock calls). Importing dynamo costs seconds, so a process that has not imported it is not
    made to: the rule is added when it is (``_AfterDynamoRules``). Once per process."""
    global _dynamo_skip_state
    with _dynamo_skip_lock:
        if _dynamo_skip_state:
            return
        rules = sys.modules.get(_DYNAMO_RULES)
        if rules is not None:
            _skip_ddpdoctor_in_dynamo(rules)
            return
        _dynamo_skip_state = "waiting"
        sys.meta_path.insert(0, _AfterDynamoRules())


def dynamo_skip_state() -> str:
    """What ``skip_in_dynamo`` achieved so far: "" (not asked), "waiting" (dynamo not imported
    yet), "done" or "failed"."""
    return _dynamo_skip_state


def cuda_event_recorder() -> Callable[[Any], None] | None:
    """``record(event)``: what ``event.record()`` does (record on this thread's current stream of
    the current device), without the Python stream object that ``torch.cuda.current_stream()``
    builds at every call: the stream objects are kept, one per stream. Measured on an H200 host
    (torch 2.11): 8.8 µs a record through ``event.record()``, 2.6 µs given the stream. None
    where this torch lacks the private calls it uses (the caller then records the public way)."""
    c = torch._C
    get_device = getattr(c, "_cuda_getDevice", None)
    get_stream = getattr(c, "_cuda_getCurrentStream", None)
    record_on = getattr(getattr(c, "_CudaEventBase", None), "record", None)
    if not (callable(get_device) and callable(get_stream) and callable(record_on)):
        return None
    streams: dict[Any, Any] = {}
    make = torch.cuda.Stream

    def record(event: Any) -> None:
        key = get_stream(get_device())  # (stream id, device index, device type): a tuple of ints
        stream = streams.get(key)
        if stream is None:
            if len(streams) >= 1024:  # streams a job makes and drops: kept bounded
                streams.clear()
            stream = streams[key] = make(stream_id=key[0], device_index=key[1], device_type=key[2])
        record_on(event, stream)

    return record
