// The sampled checks' fingerprints of CPU tensors (``tensor_values``): each tensor's L2 norm, sum
// and exact bits, in one pass a small tensor.
//
// Python twin: ddpdoctor/runtime/checks/fingerprints.py float_values, tensor_bits and fold_bits.
// Parity test: tests/test_native_hook.py::test_tensor_values_equal_the_python_fingerprint.
// Twin kept: FingerprintQueue.take calls this for CPU tensors only; a GPU model's tensors, and
// every tensor where the extension is not loaded, take the Python functions.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// The exact fingerprint of one tensor, its bits (``fingerprints.tensor_bits``): the sum of its
// elements' bit patterns, each read as an integer of the element's width (1 byte unsigned; 2, 4 and
// 8 bytes signed), modulo 2**64, folded to 53 bits (``fingerprints.fold_bits``). Integer addition
// is associative, so the value is the same whatever order the elements are added in: a rank with
// more intra-op threads, other vector instructions or the Python route gets the same value, where
// ATen's float sum of a large tensor differs in its last bits (ranks are compared for equality).
template <typename Word>
uint64_t word_sum(const void* data, int64_t n) {
  const Word* w = static_cast<const Word*>(data);
  // four running sums (unsigned: wrapping is defined), so the loop vectorizes
  uint64_t a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += static_cast<uint64_t>(static_cast<int64_t>(w[i]));
    b += static_cast<uint64_t>(static_cast<int64_t>(w[i + 1]));
    c += static_cast<uint64_t>(static_cast<int64_t>(w[i + 2]));
    d += static_cast<uint64_t>(static_cast<int64_t>(w[i + 3]));
  }
  for (; i < n; ++i) {
    a += static_cast<uint64_t>(static_cast<int64_t>(w[i]));
  }
  return a + b + c + d;
}

int64_t fold_bits(uint64_t sum) {
  return static_cast<int64_t>((sum ^ (sum >> 53)) & ((uint64_t{1} << 53) - 1));
}

int64_t tensor_bits(const at::Tensor& t) {
  if (t.is_sparse() || t.is_complex() || t.numel() == 0 || t.is_quantized()) {
    return 0;
  }
  // a dense tensor without overlaps (contiguous, channels_last, a transpose) holds its elements in
  // numel slots from its first; another (an expanded or sliced view) is copied first
  const at::Tensor dense = t.is_non_overlapping_and_dense() ? t : t.contiguous();
  const char* data = static_cast<const char*>(dense.const_data_ptr());
  const int64_t size = dense.element_size();
  uint64_t (*sum)(const void*, int64_t) = nullptr;
  switch (size) {
    case 1:
      sum = &word_sum<uint8_t>;
      break;
    case 2:
      sum = &word_sum<int16_t>;
      break;
    case 4:
      sum = &word_sum<int32_t>;
      break;
    case 8:
      sum = &word_sum<int64_t>;
      break;
    default:
      return 0;
  }
  // split across the intra-op threads as ATen splits its own sums (the order does not matter)
  const uint64_t total = at::parallel_reduce(
      int64_t{0}, dense.numel(), at::internal::GRAIN_SIZE, uint64_t{0},
      [&](int64_t begin, int64_t end, uint64_t) { return sum(data + begin * size, end - begin); },
      [](uint64_t a, uint64_t b) { return a + b; });
  return fold_bits(total);
}

// What ``float_pass`` reads from a tensor.
struct FloatPass {
  double squares = 0.0;
  double sum = 0.0;
  uint64_t bits = 0;
};

// One pass over a floating-point tensor's elements: the sum of their squares and their sum, and
// their bits (``word_sum``'s). Blocks of ``kBlock`` elements are summed in float32 over eight lanes
// (a loop that vectorizes), each block's sums added into double; the block's words are summed
// while it is still in the first-level cache, so memory is read once.
template <typename T, typename Word>
FloatPass float_pass(const char* data, int64_t n) {
  static_assert(sizeof(T) == sizeof(Word), "an element is read as a word of its width");
  constexpr int64_t kBlock = 1024;
  constexpr int kLanes = 8;
  FloatPass out;
  const T* x = reinterpret_cast<const T*>(data);
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t m = std::min(kBlock, n - start);
    const T* block = x + start;
    float q[kLanes] = {};
    float s[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= m; i += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float v = static_cast<float>(block[i + k]);
        q[k] += v * v;
        s[k] += v;
      }
    }
    double qd = 0.0;
    double sd = 0.0;
    for (int k = 0; k < kLanes; ++k) {
      qd += q[k];
      sd += s[k];
    }
    for (; i < m; ++i) {
      const double v = static_cast<double>(static_cast<float>(block[i]));
      qd += v * v;
      sd += v;
    }
    out.squares += qd;
    out.sum += sd;
    out.bits += word_sum<Word>(block, m);
  }
  return out;
}

// Tensors up to this many elements are read by ``float_pass``: there the three operator calls a
// tensor (norm, sum, bits) cost more than the pass, and cold, at a sampled step, far more (the
// 18 tensors of the hot-path bench's MLP: 32 µs a fingerprint before, 21 after). Above it ATen's
// kernels, vectorized for the machine's widest instructions, read faster than this portable loop.
constexpr int64_t kFloatPassMax = 32768;

// ``float_pass`` over a float32, float16 or bfloat16 tensor (copied first where it is not dense);
// false for another dtype (the caller takes ATen's kernels). In one call: up to ``kFloatPassMax``
// elements, ATen would not split the work across its intra-op threads either.
bool small_float_pass(const at::Tensor& t, FloatPass& out) {
  FloatPass (*pass)(const char*, int64_t) = nullptr;
  switch (t.scalar_type()) {
    case at::kFloat:
      pass = &float_pass<float, int32_t>;
      break;
    case at::kHalf:
      pass = &float_pass<c10::Half, int16_t>;
      break;
    case at::kBFloat16:
      pass = &float_pass<c10::BFloat16, int16_t>;
      break;
    default:
      return false;
  }
  const at::Tensor dense = t.is_non_overlapping_and_dense() ? t : t.contiguous();
  out = pass(static_cast<const char*>(dense.const_data_ptr()), dense.numel());
  return true;
}

// The fingerprint of each tensor (SampledChecks, at sampled steps): its L2 norm and its bits
// (``tensor_bits``), which is what ranks are compared by; the sum of each tensor from
// ``sums_from`` on (the buffers). Zeros for a sparse, complex or empty tensor. A small float32, float16 or bfloat16
// tensor is read once (``float_pass``), its norm and sum given as float32: the values
// ``fingerprints.float_values`` gives to float32 rounding (summed in another order), the bits
// equal. Another tensor takes ATen's kernels, as the Python route does. In Python, five operator
// calls a tensor cost 1.1 ms for the 58 tensors of an 8-layer BatchNorm MLP.
std::tuple<std::vector<double>, std::vector<double>, std::vector<int64_t>> tensor_values(
    const std::vector<at::Tensor>& tensors, int64_t sums_from) {
  at::NoGradGuard no_grad;
  std::vector<double> norms;
  std::vector<double> sums;
  std::vector<int64_t> bits;
  norms.reserve(tensors.size());
  bits.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const bool summed = static_cast<int64_t>(i) >= sums_from;
    if (t.is_sparse() || t.is_complex() || t.numel() == 0) {
      norms.push_back(0.0);
      if (summed) {
        sums.push_back(0.0);
      }
      bits.push_back(0);
      continue;
    }
    FloatPass pass;
    if (!t.is_quantized() && t.device().is_cpu() && t.numel() <= kFloatPassMax && small_float_pass(t, pass)) {
      norms.push_back(static_cast<double>(static_cast<float>(std::sqrt(pass.squares))));
      if (summed) {
        sums.push_back(static_cast<double>(static_cast<float>(pass.sum)));
      }
      bits.push_back(fold_bits(pass.bits));
      continue;
    }
    // no detach: nothing is recorded under the guard; the 0-dim results are read in place
    // (``item`` is one more operator call each)
    const at::Tensor f = t.to(at::kFloat);
    const at::Tensor norm = at::linalg_vector_norm(f, 2);
    norms.push_back(static_cast<double>(*norm.const_data_ptr<float>()));
    if (summed) {
      const at::Tensor sum = f.sum();
      sums.push_back(static_cast<double>(*sum.const_data_ptr<float>()));
    }
    bits.push_back(tensor_bits(t));
  }
  return {std::move(norms), std::move(sums), std::move(bits)};
}

}  // namespace
