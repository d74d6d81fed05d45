"""Optimizer step timing through torch's global optimizer hooks (one registration a process)."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpdoctor.runtime.monitor import Monitor

_monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def watch(monitor: Monitor) -> None:
    """Time every ``optimizer.step()`` in this process for ``monitor``."""
    global _registered
    with _lock:
        _monitors.add(monitor)
        if _registered:
            return
        _registered = True
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(_pre)
    register_optimizer_step_post_hook(_post)


def _pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    for monitor in list(_monitors):
        monitor.on_optimizer(start=True)


def _post(optimizer: Any, args: Any, kwargs: Any) -> None:
    for monitor in list(_monitors):
        monitor.on_optimizer(start=False)
