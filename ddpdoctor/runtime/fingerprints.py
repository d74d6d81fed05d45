"""Cheap tensor fingerprints (L2 norm and sum per tensor), without synchronizing the device.

On CPU the values are read at once. On CUDA they are copied to pinned host memory behind an
event and read once the event has passed (``poll``), so taking one never blocks the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def tensor_values(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A row (L2 norm, sum) per tensor, in float32; zeros for a sparse, complex or empty tensor.

    ``torch.linalg.vector_norm`` is what ``Tensor.norm()`` runs (the same kernel, equal values),
    without its Python dispatch; the native extension's ``tensor_values`` runs the same kernels
    from C++, so ranks on either route fingerprint alike."""
    norms = []
    sums = []
    vector_norm = torch.linalg.vector_norm
    for t in tensors:
        if t.is_sparse or t.is_complex() or t.numel() == 0:
            zero = torch.zeros((), device=t.device)
            norms.append(zero)
            sums.append(zero)
            continue
        f = t.detach().float()
        norms.append(vector_norm(f))
        sums.append(f.sum())
    if not norms:
        return torch.zeros((0, 2))
    return torch.stack((torch.stack(norms), torch.stack(sums)), dim=1)


class Fingerprinter:
    """Takes fingerprints and hands them to ``deliver(meta, norms, sums)`` when they are readable."""

    def __init__(
        self,
        deliver: Callable[[Any, list[float], list[float]], None],
        native: Callable[[list[torch.Tensor]], tuple[list[float], list[float]]] | None = None,
    ) -> None:
        self._deliver = deliver
        #: the native extension's ``tensor_values`` (CPU tensors, one call), where it is loaded
        self._native = native
        #: fingerprints still being copied from the device (bounded by the checks in flight: a few)
        self.pending: list[tuple[torch.Tensor, Any, Any]] = []

    def take(self, tensors: list[torch.Tensor], meta: Any) -> None:
        native = self._native
        if native is not None and all(t.device.type == "cpu" for t in tensors):
            norms, sums = native(tensors)
            self._deliver(meta, norms, sums)
            return
        with torch.no_grad():
            values = tensor_values(tensors)
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((host, event, meta))
        else:
            self._deliver(meta, values[:, 0].tolist(), values[:, 1].tolist())

    def poll(self) -> None:
        """Deliver every fingerprint whose copy has finished (never waits)."""
        while self.pending and self.pending[0][1].query():
            host, _, meta = self.pending.pop(0)
            self._deliver(meta, host[:, 0].tolist(), host[:, 1].tolist())

    def drain(self) -> None:
        """Deliver every pending fingerprint, waiting for the device (end of run only)."""
        while self.pending:
            host, event, meta = self.pending.pop(0)
            event.synchronize()
            self._deliver(meta, host[:, 0].tolist(), host[:, 1].tolist())
