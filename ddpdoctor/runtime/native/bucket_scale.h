// The bucket's scale on the CPU: ``buffer.mul_(1 / divisor)`` through the vector loops of lanes.h
// (the non-finite check in the same pass), split over the intra-op threads for a large bucket, and
// the non-finite check alone for a bucket scaled otherwise.
//
// Python twin: torch's ``mul_`` (the bits), and ddpdoctor/runtime/checks/nonfinite.py NonFiniteWatch's
// per-bucket ``torch.isfinite`` (the Python route's check). Parity tests: tests/test_ddp_divisor.py
// (the native route trains the bits of plain DDP), tests/test_silent_killers.py (a NaN found on
// both routes).
// Twin kept: the Python route checks CUDA buckets and buckets this does not scale; the rule
// itself (finite or not) is IEEE's, not copied.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>

#include "lanes.h"

namespace {

// A bucket of at most this many elements is scaled by ``multiply_checked`` below in one go; a
// larger one in pieces of this size over the intra-op threads (torch's own grain size).
constexpr int64_t kSmallBucket = 32768;

// A plain CPU buffer that the loops of lanes.h may read and write: contiguous, float or double, and
// nothing of autograd's or of a lazy view's on it.
bool plain_cpu_buffer(const at::Tensor& buffer) {
  const at::ScalarType dtype = buffer.scalar_type();
  return buffer.device().is_cpu() && buffer.is_contiguous() && !buffer.is_inference() && !buffer.is_conj() &&
         !buffer.is_neg() && !buffer.requires_grad() && (dtype == at::kFloat || dtype == at::kDouble);
}

// What a multiply of a bucket found: not done (not a plain CPU buffer), every element finite, or
// some NaN or infinite one.
enum class Scaled { kNotDone, kFinite, kNonFinite };

// ``multiply`` over ``data[0, n)``: at once for a small bucket, split over the intra-op threads
// for a larger one; true when any element was not finite.
template <typename T>
bool multiply_split(T* data, int64_t n, T s, bool (*multiply)(T*, int64_t, T)) {
  if (n <= kSmallBucket) {
    return multiply(data, n, s);
  }
  std::atomic<bool> any{false};
  at::parallel_for(0, n, kSmallBucket, [&](int64_t begin, int64_t end) {
    if (multiply(data + begin, end - begin, s)) {
      any.store(true, std::memory_order_relaxed);
    }
  });
  return any.load();
}

// ``buffer.mul_(1 / divisor)`` for a contiguous float or double buffer on the CPU, without the
// dispatcher and TensorIterator: their microsecond and a half a call is most of what scaling a
// model of small buckets costs a step (DDP itself scales as it copies the gradients in, which a
// comm hook cannot). A bucket larger than ``kSmallBucket`` elements is split over the intra-op
// threads at torch's own grain size, as ``mul_`` splits it. The version counter moves as
// ``mul_`` moves it. The non-finite check rides the same pass.
Scaled multiply_checked(at::Tensor& buffer, double scale) {
  if (!plain_cpu_buffer(buffer)) {
    return Scaled::kNotDone;
  }
  const int64_t n = buffer.numel();
  const bool bad = buffer.scalar_type() == at::kFloat
                       ? multiply_split(buffer.data_ptr<float>(), n, static_cast<float>(scale), multiply_floats)
                       : multiply_split(buffer.data_ptr<double>(), n, scale, multiply_doubles);
  buffer.unsafeGetTensorImpl()->bump_version();
  return bad ? Scaled::kNonFinite : Scaled::kFinite;
}

// Whether ``tensor`` (a bucket, after a scaling that was not ``multiply_checked``'s) holds a NaN
// or an infinity: the loops of lanes.h where they apply, torch's kernels otherwise.
bool any_nonfinite(const at::Tensor& tensor) {
  if (tensor.layout() != c10::kStrided || !at::isFloatingType(tensor.scalar_type())) {
    return false;  // (sparse gradients are not looked at; integers are always finite)
  }
  if (plain_cpu_buffer(tensor)) {
    return tensor.scalar_type() == at::kFloat ? nonfinite_floats(tensor.data_ptr<float>(), tensor.numel())
                                              : nonfinite_doubles(tensor.data_ptr<double>(), tensor.numel());
  }
  return !at::isfinite(tensor).all().item<bool>();
}

}  // namespace
