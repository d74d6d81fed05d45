"""Zero-code instrumentation: what ``ddpdoctor run`` injects into every Python process.

``site/sitecustomize.py`` waits for ``torch.nn.parallel.distributed`` to be imported and calls
``patch`` on it. ``patch`` wraps ``DistributedDataParallel.__init__`` so that, after DDP's own
constructor, the instance is instrumented with the settings ``ddpdoctor run`` put in the
environment (``DDPDOCTOR_RUN_DIR``, ``DDPDOCTOR_ENDPOINT``, ``DDPDOCTOR_HANG_TIMEOUT``,
``DDPDOCTOR_TOKEN``). Patching the class, not a module attribute, reaches every way a script can
name it (``from torch.nn.parallel import DistributedDataParallel as DDP``, ``torch.nn.parallel.
DistributedDataParallel``, a subclass, PyTorch Lightning's strategy).

Never twice: an instance ddpdoctor builds itself (the drop-in class, ``rewrap``) is left to the
code that built it, and an instance already instrumented is skipped (a later explicit
``ddpdoctor.instrument`` returns the same monitor). Any failure warns once and leaves training
untouched.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

#: The folder ``ddpdoctor run`` puts first on ``PYTHONPATH`` (it holds only ``sitecustomize.py``).
SITE_DIR = Path(__file__).resolve().parent / "site"
#: Set on the patched ``__init__`` so a module executed twice is patched once.
_MARK = "__ddpdoctor_autoload__"

_warned = False
_lock = threading.Lock()
#: Monitors this hook attached (the script never sees them, so the hook closes them).
_attached: weakref.WeakSet[Any] = weakref.WeakSet()


def patch(module: ModuleType) -> None:
    """Wrap ``module.DistributedDataParallel.__init__`` (``torch.nn.parallel.distributed``)."""
    cls = module.DistributedDataParallel
    original = cls.__init__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        # the frame that wrote ``DistributedDataParallel(...)`` (or a subclass's super().__init__)
        caller = sys._getframe(1)
        try:
            _after_init(self, caller)
        except Exception as exc:  # noqa: BLE001 - attaching must never break the user's DDP(...) call
            warn_once(exc)
        finally:
            del caller

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__
    _guard_destroy(module.dist)


def _guard_destroy(dist: Any) -> None:
    """Close the hook's monitors before the default process group is destroyed.

    A monitor holds its DDP model until it is closed. A script that lets its model go out of scope
    and then calls ``destroy_process_group()`` expects the reducer to be gone by then; with torch
    2.13 gloo a reducer that outlives its process group can abort the process at exit. So the
    monitors the script does not know about are closed (log ended, model released) and collected
    right before the group goes, which restores the order the script had without ddpdoctor.
    ``dist`` is ``torch.distributed`` (typed Any: its functions are replaced here, and a
    ``ModuleType`` declares no attributes to assign).
    """
    original = dist.destroy_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = args[0] if args else kwargs.get("group")
        if group is None and len(_attached):
            try:
                for monitor in list(_attached):
                    monitor.close()
                gc.collect()
            except Exception as exc:  # noqa: BLE001 - closing a monitor must never stop destroy_process_group
                warn_once(exc)
        return original(*args, **kwargs)

    setattr(destroy_process_group, _MARK, True)
    dist.destroy_process_group = destroy_process_group
    c10d = getattr(dist, "distributed_c10d", None)
    if c10d is not None and getattr(c10d, "destroy_process_group", None) is original:
        c10d.destroy_process_group = destroy_process_group


def _built_by_ddpdoctor(ddp: Any, caller: Any) -> bool:
    """The drop-in class and ``rewrap`` attach (or move) a monitor themselves."""
    if any(c.__module__.startswith("ddpdoctor.") for c in type(ddp).__mro__):
        return True
    name = caller.f_globals.get("__name__", "") if caller is not None else ""
    return name == "ddpdoctor" or name.startswith("ddpdoctor.")


def _after_init(ddp: Any, caller: Any) -> None:
    if _built_by_ddpdoctor(ddp, caller):
        return
    from ddpdoctor.runtime.attach import monitor_of
    from ddpdoctor.runtime.monitor import instrument

    if monitor_of(ddp) is not None:
        return
    previous = _watching(ddp.module)
    if previous is not None:
        # the script built a new DDP over the model it trained (after unfreezing a layer, as DDP
        # requires): the same log goes on, in a new header segment, as ``ddpdoctor.rewrap`` does;
        # the old instance is left as the script left it (its reducer goes when the script drops it)
        previous.reattach(ddp)
        return
    monitor = instrument(ddp)  # settings from the environment; never raises (a failure warns and detaches)
    if hasattr(monitor, "ddp"):  # a real monitor (not the do-nothing one)
        _attached.add(monitor)


def _watching(module: Any) -> Any:
    """The open monitor this hook attached to a DDP over ``module`` that is still alive, if any."""
    for monitor in list(_attached):
        old = monitor.ddp
        if old is not None and not monitor.closed and getattr(old, "module", None) is module:
            return monitor
    return None


def warn_once(exc: BaseException) -> None:
    """Warn about a failure of the hook itself, once per process."""
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    from ddpdoctor.categories import ProbeDisabledWarning, warn

    warn(
        f"ddpdoctor run: could not instrument a DistributedDataParallel model "
        f"({type(exc).__name__}: {exc}); training goes on unmonitored",
        ProbeDisabledWarning,
        stacklevel=3,
    )
