"""Cheap tensor fingerprints (L2 norm and bits per tensor, and a buffer's sum), without
synchronizing the device.

The norm says how large a difference is; the bits say whether there is one. They are the sum of
the elements' bit patterns as integers (``tensor_bits``): integer addition is associative, so
every rank gets the same value for the same tensor however its sum is split. ATen's float sum of
a large tensor is not: its last bits depend on the intra-op thread count and the vector
instructions, and ranks whose parameters were identical were reported apart. A buffer's float
sum is kept: it tells a buffer that changed between two fingerprints of the same rank.

On CPU the values are read at once. On CUDA they are copied to pinned host memory behind an
event and read once the event has passed (``poll``), so taking one never blocks the host.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

_np: Any
try:  # torch runs without numpy (it warns); the sums then take ATen's slower integer path
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is installed wherever torch's wheels are tested
    _np = None


def float_values(tensors: list[torch.Tensor], sums_from: int = 0) -> torch.Tensor:
    """The L2 norm of every tensor, then the sum of each from ``sums_from`` on (the buffers: a
    parameter's bits say all its sum would), in float32 on the tensors' device, in one row;
    zeros for a sparse, complex or empty tensor.

    ``torch.linalg.vector_norm`` is what ``Tensor.norm()`` runs (the same kernel, equal values),
    without its Python dispatch; the native extension's ``tensor_values`` gives the same values to
    float32 rounding (a small float tensor read once in C++, another with the same kernels)."""
    norms = []
    sums = []
    vector_norm = torch.linalg.vector_norm
    for i, t in enumerate(tensors):
        if t.is_sparse or t.is_complex() or t.numel() == 0:
            zero = torch.zeros((), device=t.device)
            norms.append(zero)
            if i >= sums_from:
                sums.append(zero)
            continue
        f = t.detach().float()
        norms.append(vector_norm(f))
        if i >= sums_from:
            sums.append(f.sum())
    if not norms:
        return torch.zeros((0,))
    return torch.stack(norms + sums)


_IS_CPU = operator.attrgetter("is_cpu")
#: the integer a tensor's elements are read as, by element size (``tensor_bits``)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK64 = (1 << 64) - 1
_MASK53 = (1 << 53) - 1


def fold_bits(total: int) -> int:
    """A word sum (any int; read modulo 2**64) folded to 53 bits, so the log's JSON keeps it exact
    in any reader (``jq`` reads numbers as doubles). The native extension folds alike."""
    total &= _MASK64
    return (total ^ (total >> 53)) & _MASK53


def tensor_bits(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the sum of its elements' bit patterns as integers of the element's width (1
    byte unsigned; 2, 4 and 8 bytes signed), modulo 2**64, on the tensors' device (int64; 0 for a
    sparse, complex, quantized or empty tensor). ``fold_bits`` of each is the fingerprint's bits.

    Exact, so equal tensors give equal values on every rank, route and device: what ranks are
    compared by. The native extension's ``tensor_values`` computes the same in one pass a tensor."""
    out = []
    for t in tensors:
        word = _WORDS.get(t.element_size())
        if word is None or t.is_sparse or t.is_complex() or t.is_quantized or t.numel() == 0:
            out.append(torch.zeros((), dtype=torch.int64, device=t.device))
            continue
        words = t.detach().view(word)
        if words.device.type == "cpu" and _np is not None:
            # ATen widens int32 words to int64 before it sums them: 12 ms for 20 MB here, where
            # numpy sums them widened as it goes in 1.5 ms (equal values: the sum is exact)
            out.append(torch.tensor(int(words.numpy().sum(dtype=_np.int64))))
        else:
            out.append(words.sum(dtype=torch.int64))
    if not out:
        return torch.zeros((0,), dtype=torch.int64)
    return torch.stack(out)


class Fingerprinter:
    """Takes fingerprints and hands them to ``deliver(meta, norms, sums, bits)`` when they are
    readable: a norm and the bits per tensor, a sum per tensor from ``sums_from`` on."""

    def __init__(
        self,
        deliver: Callable[[Any, list[float], list[float], list[int]], None],
        native: Callable[[list[torch.Tensor], int], tuple[list[float], list[float], list[int]]] | None = None,
    ) -> None:
        self._deliver = deliver
        #: the native extension's ``tensor_values`` (CPU tensors, one call), where it is loaded
        self._native = native
        #: fingerprints still being copied from the device (bounded by the checks in flight: a few)
        self.pending: list[tuple[torch.Tensor, torch.Tensor, Any, Any]] = []

    def take(self, tensors: list[torch.Tensor], sums_from: int, meta: Any) -> None:
        """Fingerprint ``tensors``: a norm and the bits of each, a sum of each from ``sums_from``."""
        native = self._native
        if native is not None and all(map(_IS_CPU, tensors)):  # (``is_cpu``: no device object a tensor)
            norms, sums, folded = native(tensors, sums_from)
            self._deliver(meta, norms, sums, folded)
            return
        with torch.no_grad():
            values = float_values(tensors, sums_from)
            bits = tensor_bits(tensors)
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            host_bits = torch.empty(bits.shape, dtype=bits.dtype, pin_memory=True)
            host_bits.copy_(bits, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((host, host_bits, event, (meta, len(tensors))))
        else:
            self._hand((meta, len(tensors)), values, bits)

    def _hand(self, meta_n: tuple[Any, int], values: torch.Tensor, bits: torch.Tensor) -> None:
        meta, n = meta_n
        row = values.tolist()
        self._deliver(meta, row[:n], row[n:], [fold_bits(b) for b in bits.tolist()])

    def poll(self) -> None:
        """Deliver every fingerprint whose copy has finished (never waits)."""
        while self.pending and self.pending[0][2].query():
            host, host_bits, _, meta_n = self.pending.pop(0)
            self._hand(meta_n, host, host_bits)

    def drain(self) -> None:
        """Deliver every pending fingerprint, waiting for the device (end of run only)."""
        while self.pending:
            host, host_bits, event, meta_n = self.pending.pop(0)
            event.synchronize()
            self._hand(meta_n, host, host_bits)
