"""DDP's own map of the parameters each step used, read at every synchronizing step.

With ``find_unused_parameters=True`` DDP all-reduces, after each synchronized backward, how many
ranks used each parameter (``Reducer._get_local_used_map``): a zero is a parameter no rank used
in that step, which DDP then marks ready itself. The sampled checks see unused parameters at the
sampled steps only; a parameter unused now and then (a branch taken on some batches, a
mixture-of-experts expert that got no tokens) can fall between them, and advice to turn the flag
off would then break the job at the first such step. This reads DDP's answer at every step, at a
few µs a step, and only in jobs that pay the flag's graph search at every forward anyway.

CPU models only: on a GPU the map is a device tensor, and reading it each step would wait for the
device (the sampled checks alone speak there, and say what they cannot see).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ddpdoctor.runtime import torch_compat

_np: Any
try:  # the map's values are read in place (without numpy the map is not read)
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is installed wherever torch's wheels are tested
    _np = None


def _gone() -> None:
    return None


class UsedMap:
    """Counts, since the last ``take``, the steps read, those with a parameter no rank used, and
    the steps whose set of such parameters differs from the step before."""

    __slots__ = ("_ddp", "_world", "_first", "steps", "unused", "changes", "_last", "_ever")

    def __init__(self, ddp: Any, world: int) -> None:
        # the DDP instance, weakly (as the monitor holds it); its reducer is read at each step,
        # so one rebuilt since (a comm hook registered before attach) is the one read
        self._ddp: Callable[[], Any] = weakref.ref(ddp)
        self._world = world  # each count is of ranks: 0 to the world size
        # the first read after attach is not counted: before DDP's first backward the map is
        # uninitialized memory (and after it, one step less is read)
        self._first = True
        self.steps = 0
        self.unused = 0
        self.changes = 0
        self._last: bytes | None = None  # the last step's pattern of unused parameters
        self._ever: Any = None  # per parameter (DDP's order): used on some step read since ``take``

    @classmethod
    def of(cls, ddp: Any, params: list[Any]) -> UsedMap | None:
        """The map of ``ddp``'s steps, where it can be read cheaply: ``find_unused_parameters``
        without ``static_graph`` (which searches only once), CPU parameters, a torch with the
        reducer's accessor, numpy. None elsewhere."""
        if not getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False):
            return None
        if not params or any(p.device.type != "cpu" for p in params):
            return None
        if _np is None or not torch_compat.available("used_map", warn=False):
            return None
        try:
            world = int(ddp.process_group.size())
        except Exception:  # noqa: BLE001 - no group to size: the map cannot be checked, so not read
            return None
        return cls(ddp, world)

    def step(self) -> None:
        """Read the map as the last synchronized backward left it (at the next step's start)."""
        ddp = self._ddp()
        if ddp is None:
            return
        try:
            counts = ddp.reducer._get_local_used_map()
        except Exception:  # noqa: BLE001 - a reducer that cannot say: the map is read no more (the sampled checks go on)
            self._ddp = _gone
            return
        if self._first or counts.device.type != "cpu" or counts.numel() == 0:
            self._first = False
            return
        values = counts.numpy()
        if values.min() < 0 or values.max() > self._world or not values.any():
            return  # not a map DDP wrote (or no parameter used at all): nothing to read
        unused = values == 0
        pattern = unused.tobytes()
        self._ever = ~unused if self._ever is None else self._ever | ~unused
        self.steps += 1
        if 1 in pattern:
            self.unused += 1
        if self._last is not None and pattern != self._last:
            self.changes += 1
        self._last = pattern

    def take(self) -> tuple[int, int, int, list[bool] | None]:
        """(steps read, of them with a parameter no rank used, changes of that set, per parameter
        in DDP's order whether some rank used it on some step read) since the last call (None:
        no step read); the counts start again."""
        ever = None if self._ever is None else self._ever.tolist()
        out = (self.steps, self.unused, self.changes, ever)
        self.steps = self.unused = self.changes = 0
        self._ever = None
        return out
