"""Optimizer step timing through torch's global optimizer hooks (one registration a process).

The hooks are process-wide: with several optimizers in one process, a monitor's optimizer time
is that of whichever optimizer steps after its backward. They are removed when the last monitor
closes, so a process that stops monitoring pays nothing for them.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpdoctor.runtime.monitor import Monitor

_monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()
_lock = threading.Lock()
_handles: list[Any] = []


def watch(monitor: Monitor) -> None:
    """Time every ``optimizer.step()`` in this process for ``monitor``."""
    with _lock:
        _monitors.add(monitor)
        if _handles:
            return
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        _handles.extend((register_optimizer_step_pre_hook(_pre), register_optimizer_step_post_hook(_post)))


def unwatch(monitor: Monitor) -> None:
    """Stop timing for ``monitor``; the hooks go when no monitor is left."""
    with _lock:
        _monitors.discard(monitor)
        if not _monitors:
            for handle in _handles:
                handle.remove()
            _handles.clear()


def _pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    for monitor in list(_monitors):
        monitor.on_optimizer(start=True)


def _post(optimizer: Any, args: Any, kwargs: Any) -> None:
    for monitor in list(_monitors):
        monitor.on_optimizer(start=False)
