"""What a sampled step's fingerprint costs the training thread: Python against the native call.

A fingerprint is each parameter's and buffer's L2 norm and exact bits, and each buffer's sum
(``runtime/checks/fingerprints.py``),
taken at every sampled step (one in ``check_every``, 50 by default). Two routes give equal
values: ``fingerprints.float_values`` and ``tensor_bits`` (Python, the fallback and CUDA's) and the extension's
``tensor_values`` (one C++ call, CPU tensors). Both run here on the same tensors, interleaved,
over three models' parameters and buffers; the figure is the median of ``--rounds`` rounds of
``--calls`` calls each, in µs per fingerprint. The values are checked first: the same bits, and
norms and sums equal to float32 rounding (the native route reads a float tensor once and
accumulates in double, ATen in float32).

``--baseline-so PATH``: an earlier build of the extension (from ``~/.cache/torch_extensions``),
timed in the same rounds: what a change to the native fingerprint costs, side by side (a build
before the exact bits computes a norm and a sum of every tensor).

    python bench/fingerprint.py [--rounds 7] [--calls 50] [--baseline-so PATH]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddpdoctor.runtime.checks.fingerprints import float_values, fold_bits, tensor_bits
from ddpdoctor.runtime.step import native_hook


def _mlp(layers: int, width: int, bn: bool) -> nn.Module:
    torch.manual_seed(0)

    def layer() -> nn.Module:
        norm: list[nn.Module] = [nn.BatchNorm1d(width)] if bn else []
        return nn.Sequential(nn.Linear(width, width), *norm, nn.ReLU())

    return nn.Sequential(*[layer() for _ in range(layers)])


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    channels = 3
    for width in (32, 32, 64, 64, 128, 128, 256, 256) * 2:
        blocks += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    return nn.Sequential(*blocks)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "MLP 9 x 64 (the hot-path bench's)": lambda: _mlp(9, 64, False),
    "MLP 40 x 64 with BatchNorm": lambda: _mlp(40, 64, True),
    "conv net, 16 conv + BatchNorm blocks (5.1 M params)": _convnet,
}


def agree(tensors: list[torch.Tensor], sums_from: int, a: tuple[list[float], list[float], list[int]], b: Any) -> bool:
    """Two fingerprints of ``tensors`` agree: the same bits, and norms and sums equal to float32
    rounding of sums taken in another order (a sum's error is bounded by its elements' magnitude,
    at most sqrt(numel) times the norm)."""
    norms_a, sums_a, bits_a = a
    norms_b, sums_b, bits_b = b
    if bits_a != bits_b or len(norms_a) != len(norms_b) or len(sums_a) != len(sums_b):
        return False
    if not all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(norms_a, norms_b, strict=True)):
        return False
    scale = [norms_a[i] * math.sqrt(max(1, t.numel())) for i, t in enumerate(tensors)][sums_from:]
    return all(abs(x - y) <= 1e-5 * (m + 1e-30) for x, y, m in zip(sums_a, sums_b, scale, strict=True))


def _time(fn: Callable[[list[torch.Tensor]], Any], tensors: list[torch.Tensor], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn(tensors)
    return (time.perf_counter_ns() - start) / calls / 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--baseline-so", type=Path, default=None)
    args = parser.parse_args()
    native = native_hook.load().tensor_values
    baseline = native_hook._import(args.baseline_so.stem, args.baseline_so).tensor_values if args.baseline_so else None

    def python(tensors: list[torch.Tensor], sums_from: int) -> tuple[list[float], list[float], list[int]]:
        row = float_values(tensors, sums_from).tolist()
        return row[: len(tensors)], row[len(tensors) :], [fold_bits(b) for b in tensor_bits(tensors).tolist()]

    print(f"torch {torch.__version__}, median of {args.rounds} rounds of {args.calls} calls, µs per fingerprint")
    print(
        f"{'model':<55} {'tensors':>7} {'Python':>9} {'native':>9} {'ratio':>6}"
        + (f" {'baseline':>9} {'native/baseline':>16}" if baseline else "")
    )
    for name, build in MODELS.items():
        model = build()
        params = list(model.parameters())
        tensors = [*params, *model.buffers()]
        n = len(params)  # a sum of the buffers alone, as the sampled checks take it
        assert agree(tensors, n, python(tensors, n), native(tensors, n)), name
        py_us, native_us, base_us = [], [], []
        for _ in range(args.rounds):
            py_us.append(_time(lambda t, n=n: python(t, n), tensors, args.calls))
            native_us.append(_time(lambda t, n=n: native(t, n), tensors, args.calls))
            if baseline is not None:
                base_us.append(_time(lambda t, n=n: baseline(t, n), tensors, args.calls))
        p, n = statistics.median(py_us), statistics.median(native_us)
        line = f"{name:<55} {len(tensors):>7} {p:>9.0f} {n:>9.0f} {n / p:>6.2f}"
        if base_us:
            b = statistics.median(base_us)
            line += f" {b:>9.0f} {n / b:>16.2f}"
        print(line)


if __name__ == "__main__":
    main()
