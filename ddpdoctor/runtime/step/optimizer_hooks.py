"""Optimizer step timing through torch's global optimizer hooks (one registration a process).

The hooks are process-wide: with several optimizers in one process, a monitor's optimizer time
is that of the first optimizer to step after its backward began (a bucket ready); one that steps
between the model's forward and its backward (a GAN's other network) is passed over, and an
optimizer whose step runs another's (``ZeroRedundancyOptimizer``) is timed to its own end, on
both routes (``tests/test_two_optimizers.py``). They are removed when the last monitor
leaves, so a process that stops monitoring pays nothing for them.

A monitor on host clocks with the native extension loaded gets C++ callables of its own
(``OptimizerStamps.pre``/``post``) instead: they stamp the clock and run no Python, and the monitor
takes the stamps at its next forward (``StepHooks.take_optimizer``). The Python hooks serve the
others (CUDA models, whose marks are CUDA events; the route without the extension).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpdoctor.runtime.protocols import OptimizerObserver


class OptimizerHooks:
    """torch's global optimizer step pre/post hooks, shared by every monitor of the process."""

    def __init__(self) -> None:
        self._observers: weakref.WeakSet[OptimizerObserver] = weakref.WeakSet()
        # what the hooks iterate, rebuilt on watch/unwatch: iterating a WeakSet at every
        # optimizer step costs more than the timing itself
        self._refs: tuple[weakref.ref[OptimizerObserver], ...] = ()
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._stamped: dict[int, list[Any]] = {}  # id of an observer -> its C++ hooks' handles

    def watch(self, observer: OptimizerObserver) -> None:
        """Time every ``optimizer.step()`` in this process for ``observer``."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        stamps = observer.optimizer_stamps()
        with self._lock:
            if stamps is not None:
                if id(observer) not in self._stamped:
                    self._stamped[id(observer)] = [
                        register_optimizer_step_pre_hook(stamps.pre),
                        register_optimizer_step_post_hook(stamps.post),
                    ]
                return
            self._observers.add(observer)
            self._snapshot()
            if self._handles:
                return
            self._handles.extend(
                (register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post))
            )

    def unwatch(self, observer: OptimizerObserver) -> None:
        """Stop timing for ``observer``; the hooks go when no observer is left."""
        with self._lock:
            for handle in self._stamped.pop(id(observer), ()):
                handle.remove()
            self._observers.discard(observer)
            self._snapshot()
            if not self._observers:
                self._remove()

    def shutdown(self) -> None:
        with self._lock:
            self._observers = weakref.WeakSet()
            self._refs = ()
            self._remove()
            for handles in self._stamped.values():
                for handle in handles:
                    handle.remove()
            self._stamped.clear()

    def _snapshot(self) -> None:
        self._refs = tuple(weakref.ref(o) for o in self._observers)

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for ref in self._refs:
            observer = ref()
            if observer is not None:  # a monitor freed without leaving
                observer.on_optimizer(True)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for ref in self._refs:
            observer = ref()
            if observer is not None:
                observer.on_optimizer(False)
