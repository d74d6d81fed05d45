"""The bucket scale's vector loops (``runtime/native/lanes.h``) against torch's ``mul_`` and ``isfinite``.

``lanes.h`` holds nothing of torch's, so a small driver built with the extension's own flags runs
its four functions (the AVX2 clone where the CPU has it) on the bytes given: the products must be
the bits ``mul_`` gives, and both flags (the multiply's and the check's alone) must say whether
``torch.isfinite`` finds an element that is not finite, for every length around the vector width
and with NaNs, infinities and subnormals among the values.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from ddpdoctor import native_cache

_DRIVER = r"""
#include "lanes.h"
#include <cstdio>
#include <vector>

// stdin: dtype (4 or 8), n, scale (double), n elements; stdout: the product, then the two flags
template <typename T>
int run(long n, double scale) {
  std::vector<T> data(n);
  if (std::fread(data.data(), sizeof(T), n, stdin) != static_cast<size_t>(n)) return 2;
  bool checked, multiplied;
  if constexpr (sizeof(T) == 4) {
    checked = nonfinite_floats(data.data(), n);
    multiplied = multiply_floats(data.data(), n, static_cast<float>(scale));
  } else {
    checked = nonfinite_doubles(data.data(), n);
    multiplied = multiply_doubles(data.data(), n, scale);
  }
  std::fwrite(data.data(), sizeof(T), n, stdout);
  const char flags[2] = {static_cast<char>(multiplied), static_cast<char>(checked)};
  std::fwrite(flags, 1, 2, stdout);
  return 0;
}

int main() {
  long width, n;
  double scale;
  if (std::fread(&width, sizeof width, 1, stdin) != 1 || std::fread(&n, sizeof n, 1, stdin) != 1 ||
      std::fread(&scale, sizeof scale, 1, stdin) != 1) return 2;
  return width == 4 ? run<float>(n, scale) : run<double>(n, scale);
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    folder = tmp_path_factory.mktemp("lanes")
    source = folder / "driver.cpp"
    source.write_text(_DRIVER)
    binary = folder / "driver"
    subprocess.run(
        ["g++", "-std=c++17", *native_cache.CFLAGS, "-I", str(native_cache.SOURCE_DIR), str(source), "-o", str(binary)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    return binary


def _values(n: int, dtype: torch.dtype, seed: int, special: float | None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 1e3
    tiny = torch.finfo(dtype).smallest_normal
    x[torch.rand(n, generator=gen) < 0.2] *= tiny  # subnormals, where the scale keeps them
    x = x.to(dtype)
    if special is not None and n:
        x[int(torch.randint(n, (1,), generator=gen))] = special
    return x


def test_the_loops_give_mul_s_bits_and_isfinite_s_answer(driver: Path) -> None:
    cases = 0
    for dtype, width in ((torch.float32, 4), (torch.float64, 8)):
        for n in (0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 13107):
            for seed, special in enumerate((None, float("nan"), float("inf"), float("-inf"))):
                for scale in (1 / 3, 0.5, 1 / 6):
                    x = _values(n, dtype, seed + n, special)
                    head = struct.pack("=qqd", width, n, scale)
                    out = subprocess.run(
                        [str(driver)], input=head + x.numpy().tobytes(), capture_output=True, timeout=30, check=True
                    ).stdout
                    expected = x.clone().mul_(scale)
                    assert out[:-2] == expected.numpy().tobytes(), (dtype, n, special, scale)
                    nonfinite = not bool(torch.isfinite(x).all())
                    assert out[-2:] == bytes([nonfinite, nonfinite]), (dtype, n, special, out[-2:])
                    cases += 1
    assert cases == 2 * 13 * 4 * 3
