"""A rank's look at its own gradients before DDP averages them: NaN and infinity, and where.

Three routes, one per way the buckets reach ddpdoctor:

- the native hook on CPU: ``DdpScale`` checks each bucket in its scaling pass (the multiply's
  own loop) and sets a word that Python reads once a step (``word``: a one-element int64
  tensor read through ctypes, no call); the bucket's parameters and counts are taken only then;
- the Python comm hook on CPU (no extension, or a user's hook): ``check_bucket`` reads the
  bucket once (``torch.isfinite``) before the inner hook;
- a CUDA bucket: ``check_bucket`` folds the bucket's largest magnitude (NaN and inf propagate)
  into a per-bucket flag on the device, two kernels on the gradient's stream, never read there;
  ``poll`` copies the flags to pinned host memory without waiting (at the sampled steps) and
  reads the copy once its event has passed. No synchronization: the step is then known to
  within the steps since the copy before.

Only a rank's first non-finite step is reported (``reported``): from the step after, every rank's
gradients are NaN, which says nothing more.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.nonfinite import rank_nonfinite


class NonFiniteWatch:
    """One DDP instance's non-finite check on one rank."""

    def __init__(self, ddp: Any, rank: int) -> None:
        self.rank = rank
        named = list(ddp.module.named_parameters())
        self._named = named
        self._by_cdata = {p._cdata: n for n, p in named}  # (the native side names TensorImpl addresses)
        self._by_id = {id(p): n for n, p in named}
        #: the word the native scale sets to 1 when a bucket is not finite (read: ``word.value``)
        self.flag = torch.zeros(1, dtype=torch.int64)
        self.word = ctypes.c_int64.from_address(self.flag.data_ptr())
        self._scale: Any = None
        #: buckets found not finite by the Python check since the last take
        self._python: list[dict[str, Any]] = []
        #: a rank's first non-finite step was reported: nothing more is looked at
        self.reported = False
        # the CUDA route's device flags (largest magnitude per bucket), their host copy in flight
        # and the steps it covers
        self._device: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._copied_from = 0  # first step the copy in flight covers
        self._copied_to = 0  # last step it covers
        self._since = 0  # first step the device flags cover now

    # -- native route ----------------------------------------------------------------------

    def watch_native(self, scale: Any) -> bool:
        """Have the native ``DdpScale`` check every bucket in its scaling pass (False: this build
        of the extension cannot)."""
        watch = getattr(scale, "watch_nonfinite", None)
        if watch is None:
            return False
        watch(self.flag)
        self._scale = scale
        return True

    def stop(self) -> None:
        """No more looking (reported, or detached)."""
        if self._scale is not None:
            try:
                self._scale.watch_nonfinite(None)
            except Exception:  # noqa: BLE001, S110 - the scale may be gone with its reducer; nothing to stop then
                pass
        self._scale = None

    # -- Python route ----------------------------------------------------------------------

    def check_bucket(self, bucket: Any, step: int) -> None:
        """The Python comm hook's look at ``bucket`` before the inner hook (training thread)."""
        if self.reported:
            return
        buffer = bucket.buffer()
        if not buffer.is_floating_point():
            return
        if buffer.is_cuda:
            self._fold_device(bucket.index(), buffer)
            return
        if bool(torch.isfinite(buffer).all()):
            return
        params = []
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=False):
            nan, inf = int(torch.isnan(g).sum()), int(torch.isinf(g).sum())
            if nan or inf:
                params.append({"name": self._by_id.get(id(p), "?"), "nan": nan, "inf": inf})
        self._python.append({"bucket": bucket.index(), "params": params})
        self.word.value = 1

    def _fold_device(self, index: int, buffer: torch.Tensor) -> None:
        flags = self._device
        if flags is None or index >= flags.numel() or flags.device != buffer.device:
            grown = torch.zeros(max(index + 1, 8), dtype=torch.float32, device=buffer.device)
            if flags is not None and flags.device == buffer.device:
                grown[: flags.numel()].copy_(flags)
            flags = self._device = grown
        # the largest magnitude: NaN and inf propagate, and no finite bucket overflows it (float64
        # buckets are reduced in their own dtype: vector_norm refuses a narrowing dtype)
        wide = buffer.dtype == torch.float64
        peak = torch.linalg.vector_norm(buffer, ord=float("inf"), dtype=None if wide else torch.float32)
        if wide:
            peak = peak.to(torch.float32)
        slot = flags[index]
        torch.maximum(slot, peak, out=slot)

    def poll(self, step: int, start_copy: bool) -> Finding | None:
        """CUDA route, at a forward (``step`` opens): read the copy in flight if its event has
        passed; with ``start_copy`` (a sampled step), copy the device flags without waiting."""
        if self.reported or self._device is None:
            return None
        found = None
        if self._event is not None and self._event_done():
            host = self._host
            assert host is not None
            bad = [i for i, v in enumerate(host.tolist()) if v != v or v in (float("inf"), float("-inf"))]
            self._event = None
            if bad:
                found = rank_nonfinite(
                    self.rank,
                    self._copied_from,
                    [{"bucket": i, "params": []} for i in bad],
                    last_step=self._copied_to,
                    device="cuda",
                )
        if start_copy and self._event is None and found is None:
            device = self._device
            if self._host is None or self._host.numel() != device.numel():
                pin = device.is_cuda and torch.cuda.is_available()
                self._host = torch.empty(device.numel(), dtype=torch.float32, pin_memory=pin)
            self._host.copy_(device, non_blocking=device.is_cuda)
            device.zero_()  # (after the copy on the same stream)
            self._copied_from, self._copied_to, self._since = self._since, step - 1, step
            if device.is_cuda:
                self._event = torch.cuda.Event()
                self._event.record()
            else:
                self._event = True  # (a CPU tensor: the copy is done)
        return found

    def _event_done(self) -> bool:
        event = self._event
        return event is True or bool(event.query())

    # -- what was found ----------------------------------------------------------------------

    def take(self, step: int) -> Finding | None:
        """``word`` was set: the buckets found since, as this rank's finding at ``step`` (the step
        whose backward found them), or None if nothing is left to say."""
        self.word.value = 0
        buckets = list(self._python)
        self._python.clear()
        if self._scale is not None:
            for index, params in self._scale.take_nonfinite():
                buckets.append(
                    {
                        "bucket": int(index),
                        "params": [
                            {"name": self._by_cdata.get(addr, "?"), "nan": int(nan), "inf": int(inf)}
                            for addr, nan, inf in params
                        ],
                    }
                )
        if self.reported or not buckets:
            return None
        merged = _merged(buckets)
        return rank_nonfinite(self.rank, step, merged, weights_finite=self._weights_finite(merged))

    def _weights_finite(self, buckets: list[dict[str, Any]]) -> bool | None:
        """Whether the parameters whose gradients were not finite are finite now, after their step
        (CPU: read here, once; False: the update took the NaN in). None: not known."""
        wanted = {p["name"] for b in buckets for p in b["params"]}
        params = [p for n, p in self._named if n in wanted]
        if not params or any(p.is_cuda for p in params):
            return None
        with torch.no_grad():
            return all(bool(torch.isfinite(p).all()) for p in params)

    def mark_reported(self) -> None:
        self.reported = True
        self.stop()


def _merged(buckets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per bucket (a bucket seen twice: a second backward in the same step)."""
    out: dict[int, dict[str, Any]] = {}
    for b in buckets:
        seen = out.setdefault(b["bucket"], {"bucket": b["bucket"], "params": []})
        names = {p["name"] for p in seen["params"]}
        seen["params"] += [p for p in b["params"] if p["name"] not in names]
    return [out[i] for i in sorted(out)]
