// The bucket scale's vector loops: ``data[i] *= s`` with the non-finite check in the same pass, or
// the check alone (read only), 32 bytes at a time; one template, the multiply a compile-time switch.
// Nothing of torch's here: tests and benches build it alone.
//
// Python twin: torch's ``mul_`` (the product's bits) and ``torch.isfinite`` (the check), which
// ddpdoctor/runtime/checks/nonfinite.py NonFiniteWatch calls on the Python route. Parity tests:
// tests/test_ddp_divisor.py (the native route trains the bits of plain DDP),
// tests/test_silent_killers.py (a NaN or an infinity is found on both routes).
// Twin kept: the Python route's buckets (CUDA, a user's hook) are read by torch's kernels; the
// rule (IEEE's) is not copied.

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// Over ``n`` elements, a 32-byte vector at a time (GCC and Clang vector types): ``data[i] *= s``
// where ``kScale`` (per element the IEEE product of the same two operands that torch's ``mul_``
// kernel forms, so the same bits), and in the same pass whether some element was NaN or infinite
// (``x - x`` is +0 for every finite ``x`` and NaN otherwise, so the OR of its bits is 0 exactly
// when all are finite: a subtract and an OR a vector, off the multiply's path, an OR's latency on
// the chain). Without ``kScale`` only the check runs and ``data`` is read only: a bucket DDP
// divides in place (``div_``), checked after its scaling.
template <bool kScale, typename T>
inline __attribute__((always_inline)) bool checked_lanes(std::conditional_t<kScale, T*, const T*> data, int64_t n,
                                                         T s = T(1)) {
  int64_t i = 0;
  bool bad = false;
#if defined(__GNUC__) || defined(__clang__)
  using Bits = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef T Lanes __attribute__((vector_size(32)));
  typedef Bits BitLanes __attribute__((vector_size(32)));
  constexpr int64_t kLanes = 32 / sizeof(T);
  [[maybe_unused]] Lanes factor;
  if constexpr (kScale) {
    for (int64_t k = 0; k < kLanes; ++k) {
      factor[k] = s;
    }
  }
  BitLanes seen = {};
  for (; i + kLanes <= n; i += kLanes) {
    Lanes v;
    std::memcpy(&v, data + i, sizeof v);
    const Lanes zero_or_nan = v - v;
    BitLanes bits;
    std::memcpy(&bits, &zero_or_nan, sizeof bits);
    seen |= bits;
    if constexpr (kScale) {
      v *= factor;
      std::memcpy(data + i, &v, sizeof v);
    }
  }
  for (int64_t k = 0; k < kLanes; ++k) {
    bad = bad || seen[k] != 0;
  }
#endif
  for (; i < n; ++i) {
    const T x = data[i];
    bad = bad || (x - x) != T(0);
    if constexpr (kScale) {
      data[i] = x * s;
    }
  }
  return bad;
}

// Built twice on x86-64 Linux with GCC, picked at load by the CPU (AVX2 where it has it, as
// torch's own kernels are): the build may be shared by the hosts of a cluster, so nothing beyond
// the baseline is assumed. A small bucket: 2.4 µs for five of 13,107 floats with AVX2, against
// 7.3 through ``mul_`` and 5.0 in 16-byte vectors (this project's VM).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define DDPDOCTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DDPDOCTOR_CLONES
#endif

DDPDOCTOR_CLONES bool multiply_floats(float* data, int64_t n, float s) {
  return checked_lanes<true, float>(data, n, s);
}

DDPDOCTOR_CLONES bool multiply_doubles(double* data, int64_t n, double s) {
  return checked_lanes<true, double>(data, n, s);
}

DDPDOCTOR_CLONES bool nonfinite_floats(const float* data, int64_t n) {
  return checked_lanes<false, float>(data, n);
}

DDPDOCTOR_CLONES bool nonfinite_doubles(const double* data, int64_t n) {
  return checked_lanes<false, double>(data, n);
}

}  // namespace
