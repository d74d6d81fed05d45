// DDP's own scaling, bit for bit.
//
// Without a comm hook, DDP's reducer scales each gradient as it hands it to its bucket: it
// multiplies by the reciprocal of its divisor as it copies a gradient in, and divides in place a
// dense gradient that already is its bucket view (gradient_as_bucket_view=True with gradients
// kept between steps) and every sparse gradient. With a hook registered it only copies, and the
// hook scales. A multiply by the reciprocal and a divide give other bits whenever the divisor is
// not a power of two (world size 3, 6, 12, 24...), so ``DdpScale`` replays DDP's choice per
// gradient. The divisor is the reducer's own: the world size, or under
// Join(divide_by_initial_world_size=False) the ranks still training, which DDP counts in each
// forward. The reducer has no accessor for it, so its private member is read through an explicit
// instantiation (which the language exempts from access checks); native_cache.source_text
// defines DDPDOCTOR_REDUCER_DIV_FACTOR only where torch's reducer.hpp declares that member, and
// without it the divisor is the world size (and Python says the Join case is not honoured).
//
// Python twin: none of the rule; the Python route calls this same DdpScale
// (ddpdoctor/runtime/step/native_hook.py ddp_scale, comm_hook.mean_allreduce). Without the extension
// mean_allreduce multiplies by 1/world size and says where that differs (views_divided_inexactly).
// Parity test: tests/test_ddp_divisor.py (both routes train the bits of plain DDP at world size 3).
// Twin kept: no copy to keep; one implementation.

#pragma once

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <ATen/ScalarOps.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "accumulator_hooks.h"
#include "bucket_scale.h"

namespace {

#ifdef DDPDOCTOR_REDUCER_DIV_FACTOR
template <typename Tag, typename Tag::type Member>
struct Expose {
  friend typename Tag::type member_of(Tag) {
    return Member;
  }
};
struct DivFactor {
  using type = int c10d::Reducer::*;
  friend type member_of(DivFactor);
};
template struct Expose<DivFactor, &c10d::Reducer::div_factor_>;
constexpr bool kReadsDivisor = true;
#else
constexpr bool kReadsDivisor = false;
#endif

bool power_of_two(int64_t n) {
  return n > 0 && (n & (n - 1)) == 0;
}

// Per reduced parameter, whether its gradient stays its bucket view through the backward's
// accumulation (DDP then divides it in place): known only before the accumulation, so a pre-hook
// on each parameter's gradient accumulator records there the storage of the .grad that the
// accumulation will keep (none where it makes a new tensor), with the round it belongs to. A
// round ends when the bucket flagged last is scaled. The first pre-hook of a round records every
// parameter's .grad as it is then, before any accumulation: a parameter this backward does not
// use (find_unused_parameters, static_graph) keeps that record, and DDP, which marks it ready
// without accumulating, divides it only where that .grad already is its bucket view (a tensor the
// script set is copied, and multiplied). A parameter with no record of the round (none taken: a
// watch made mid-round) is taken as its bucket view. A round in which no pre-hook ran at all
// (compiled autograd traced the backward: it runs no C++ hook of ours) takes every gradient as
// copied, as before.
//
// No lock: each pre-hook writes its own parameter's words (the first of a round, claimed by one
// compare-exchange, writes every parameter's before its own), and DDP's reducer takes its mutex
// after each accumulation and around the hook that reads them, which orders the two.
struct GradRecords {
  explicit GradRecords(size_t n) : seen(new std::atomic<uint64_t>[n]), kept(new std::atomic<uintptr_t>[n]) {
    for (size_t i = 0; i < n; ++i) {
      seen[i].store(0, std::memory_order_relaxed);
      kept[i].store(0, std::memory_order_relaxed);
    }
  }
  std::atomic<uint64_t> round{1};
  std::atomic<uint64_t> any_seen{0};  // the last round in which a pre-hook ran
  std::unique_ptr<std::atomic<uint64_t>[]> seen;   // per parameter: the round of its record
  std::unique_ptr<std::atomic<uintptr_t>[]> kept;  // per parameter: the kept .grad's storage, or 0
  std::unordered_map<const c10::TensorImpl*, size_t> slot;  // (written at construction only)
  // per parameter, not owned (a closed monitor's scale keeps no weights alive; written at
  // construction only)
  std::vector<std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>>> params;

  // Every parameter's .grad as the round begins (the first pre-hook of the round, before its own
  // record): what DDP compares with the bucket view for a parameter it marks ready unaccumulated.
  void take_all(uint64_t round) {
    for (size_t i = 0; i < params.size(); ++i) {
      auto impl = params[i] ? params[i]->lock() : c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>();
      if (!impl.defined()) {
        continue;  // (no record: taken as the bucket's view, as before)
      }
      const at::Tensor param(std::move(impl));
      const at::Tensor& grad = param.mutable_grad();
      const bool strided = grad.defined() && grad.layout() == c10::kStrided;
      kept[i].store(strided ? reinterpret_cast<uintptr_t>(grad.storage().unsafeGetStorageImpl()) : 0,
                    std::memory_order_relaxed);
      seen[i].store(round, std::memory_order_relaxed);
    }
  }
};

class GradRecord : public UntracedPreHook {
 public:
  GradRecord(std::shared_ptr<GradRecords> records, at::Tensor param, size_t slot)
      : records_(std::move(records)), param_(std::move(param)), slot_(slot) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    // AccumulateGrad adds into an existing dense .grad in place unless the backward builds a
    // graph (create_graph: grad mode on), which makes a new tensor, as a missing .grad does.
    // (mutable_grad: the accessor without grad()'s checks, which cost more than the rest here)
    const at::Tensor& grad = param_.mutable_grad();
    const bool kept = grad.defined() && grad.layout() == c10::kStrided && !at::GradMode::is_enabled();
    const uint64_t round = records_->round.load(std::memory_order_relaxed);
    uint64_t last = records_->any_seen.load(std::memory_order_relaxed);
    if (last != round && records_->any_seen.compare_exchange_strong(last, round, std::memory_order_relaxed)) {
      records_->take_all(round);  // the round's first pre-hook
    }
    const auto storage = kept ? reinterpret_cast<uintptr_t>(grad.storage().unsafeGetStorageImpl()) : 0;
    records_->kept[slot_].store(storage, std::memory_order_relaxed);
    records_->seen[slot_].store(round, std::memory_order_relaxed);
    return grads;
  }

 private:
  std::shared_ptr<GradRecords> records_;
  at::Tensor param_;  // (the accumulator holds its variable too: no cycle, the meta's link is weak)
  size_t slot_;
};

class GradWatch {
 public:
  explicit GradWatch(const std::vector<at::Tensor>& params) : records_(std::make_shared<GradRecords>(params.size())) {
    records_->params.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.defined() || !p.requires_grad() || !p.is_leaf()) {
        continue;
      }
      auto node = torch::autograd::impl::grad_accumulator(p);
      if (!node) {
        continue;
      }
      records_->slot.emplace(p.unsafeGetTensorImpl(), i);
      records_->params[i].emplace(p.getIntrusivePtr());
      auto hook = std::make_unique<GradRecord>(records_, p, i);
      torch::autograd::FunctionPreHook* raw = hook.get();
      node->add_pre_hook(std::move(hook));
      hooked_.emplace_back(Unowned<NodeRef>::type(node), raw);
    }
  }

  ~GradWatch() {
    for (auto& [weak, raw] : hooked_) {
      auto node = weak.lock();
      if (!node) {
        continue;  // gone with DDP's reducer, and our hook with it
      }
      auto& hooks = node->pre_hooks();
      for (auto it = hooks.begin(); it != hooks.end(); ++it) {
        if (it->get() == raw) {
          hooks.erase(it);
          break;
        }
      }
    }
  }

  GradWatch(const GradWatch&) = delete;
  GradWatch& operator=(const GradWatch&) = delete;

  // Per gradient of ``bucket`` (its parameters' order): 1 where DDP would divide it in place. The
  // storage is compared as DDP's is_alias_of does: a kept gradient that is not this bucket's view
  // (a tensor the script set as .grad) is copied, and multiplied.
  std::vector<char> in_place(c10d::GradBucket& bucket) {
    const auto params = bucket.getParameters();
    const c10::StorageImpl* storage = bucket.getBufferRef().storage().unsafeGetStorageImpl();
    std::vector<char> out(params.size(), 0);
    const uint64_t round = records_->round.load(std::memory_order_relaxed);
    if (records_->any_seen.load(std::memory_order_relaxed) != round) {
      return out;  // no pre-hook ran this round (compiled autograd): every gradient as copied
    }
    for (size_t j = 0; j < params.size(); ++j) {
      const at::Tensor& grad = params[j].grad();
      if (!grad.defined() || grad.storage().unsafeGetStorageImpl() != storage) {
        continue;  // no gradient (the bucket holds zeros) or not a view of this bucket
      }
      auto it = records_->slot.find(params[j].unsafeGetTensorImpl());
      if (it == records_->slot.end() || records_->seen[it->second].load(std::memory_order_relaxed) != round) {
        out[j] = 1;  // no record this round: taken as the gradient it had, kept as the bucket's view
        continue;
      }
      out[j] = records_->kept[it->second].load(std::memory_order_relaxed) == reinterpret_cast<uintptr_t>(storage) ? 1 : 0;
    }
    return out;
  }

  // After the bucket flagged last (every bucket's, whatever its scaling asked): the next round.
  void end_round() {
    records_->round.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::shared_ptr<GradRecords> records_;
  // The accumulators, not held: DDP's reducer holds them (each holds its parameter), and the
  // scale may outlive the model (in a closed monitor the script keeps).
  std::vector<std::pair<Unowned<NodeRef>::type, torch::autograd::FunctionPreHook*>> hooked_;
};

// 1/``size`` as DDP's reducer passes it to its multiply: a double scalar tensor marked as a wrapped
// number (so the bucket's dtype wins and the product is taken in its math type). Not
// ``mul_(double)``: C++'s Scalar overload rounds the reciprocal to a half-precision bucket's dtype
// first (bfloat16 and float16 gradients then differ whenever the size is not a power of 2).
at::Tensor wrapped_scale(int64_t size) {
  at::Tensor scale = c10::scalar_to_tensor(at::Scalar(1.0 / static_cast<double>(size)));
  scale.unsafeGetTensorImpl()->set_wrapped_number(true);
  return scale;
}

class DdpScale {
 public:
  DdpScale(const std::shared_ptr<c10d::Reducer>& reducer, int64_t world_size, const std::vector<at::Tensor>& params,
           bool watch)
      : reducer_(reducer), world_size_(world_size), divisor_(world_size), scale_(wrapped_scale(world_size)) {
    if (watch) {
      watch_ = std::make_unique<GradWatch>(params);
    }
  }

  // Scales ``bucket`` in place as DDP's reducer would have scaled its gradients; where a flag is
  // watched (``watch_nonfinite``), notes a bucket holding a NaN or an infinity.
  void apply(c10d::GradBucket& bucket) {
    std::lock_guard<std::mutex> lock(mu_);
    const bool bad = scale(bucket);
    if (bad && flag_.defined()) {
      note_nonfinite(bucket);
    }
    if (watch_ != nullptr && bucket.isLast()) {
      watch_->end_round();
    }
  }

  // Where to say that a bucket held a NaN or an infinity: ``flag`` (a one-element int64 CPU
  // tensor that Python reads as a plain word, one read a step) is set to 1 and the bucket's
  // details kept for ``take_nonfinite``. An undefined tensor (None) stops the watch.
  void watch_nonfinite(std::optional<at::Tensor> flag) {
    std::lock_guard<std::mutex> lock(mu_);
    if (flag && flag->defined()) {
      TORCH_CHECK(flag->device().is_cpu() && flag->scalar_type() == at::kLong && flag->numel() == 1 &&
                      flag->is_contiguous(),
                  "watch_nonfinite: a one-element int64 CPU tensor");
      flag_ = *flag;
    } else {
      flag_ = at::Tensor();
    }
  }

  // The buckets noted since the last take, in order: (bucket index, [(parameter's TensorImpl
  // address, NaN count, infinity count)] for each of its gradients that is not finite).
  std::vector<std::tuple<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t>>>> take_nonfinite() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::tuple<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t>>>> out;
    out.swap(nonfinite_);
    return out;
  }

  // The divisor DDP's reducer uses this round (the world size where it cannot be read).
  int64_t divisor() const {
#ifdef DDPDOCTOR_REDUCER_DIV_FACTOR
    if (auto reducer = reducer_.lock()) {
      const int div = (*reducer).*member_of(DivFactor());
      if (div > 0) {
        return div;
      }
    }
#endif
    return world_size_;
  }

  bool watches() const {
    return watch_ != nullptr;
  }

 private:
  // Scales the bucket; true where it holds a NaN or an infinity (looked at only while a flag is
  // watched: the multiply's own pass on a CPU bucket, a read after ``div_`` otherwise).
  bool scale(c10d::GradBucket& bucket) {
    at::Tensor& buffer = bucket.getBufferRef();
    const bool look = flag_.defined();
    const int64_t div = divisor();
    if (buffer.layout() != c10::kStrided) {
      buffer.div_(div);  // a sparse gradient: DDP divides it
      return false;
    }
    if (div == 1 && buffer.is_cuda()) {
      // by 1.0 no bit changes on a GPU (CUDA kernels keep subnormals), and that pass over every
      // gradient is what a scaling comm hook costs there; on CPU it stays (flush_denormal)
      return look && any_nonfinite(buffer);
    }
    if (div != divisor_) {
      divisor_ = div;
      scale_ = wrapped_scale(div);
    }
    const double reciprocal = 1.0 / static_cast<double>(div);  // (the value scale_ holds)
    if (watch_ == nullptr || power_of_two(div)) {
      // (dividing by a power of two gives the same bits)
      return multiply(buffer, reciprocal, look);
    }
    const std::vector<char> in_place = watch_->in_place(bucket);
    const bool all = std::all_of(in_place.begin(), in_place.end(), [](char c) { return c != 0; });
    const bool none = std::none_of(in_place.begin(), in_place.end(), [](char c) { return c != 0; });
    if (none) {
      return multiply(buffer, reciprocal, look);
    }
    if (all) {
      buffer.div_(div);
    } else {
      const std::vector<at::Tensor> views = bucket.getGradients();
      for (size_t j = 0; j < views.size() && j < in_place.size(); ++j) {
        at::Tensor view = views[j];
        if (in_place[j]) {
          view.div_(div);
        } else {
          view.mul_(scale_);
        }
      }
    }
    return look && any_nonfinite(buffer);
  }

  // ``buffer`` times ``reciprocal`` (``multiply_checked``, else torch's ``mul_``); true where it
  // holds a NaN or an infinity and ``look``.
  bool multiply(at::Tensor& buffer, double reciprocal, bool look) {
    const Scaled done = multiply_checked(buffer, reciprocal);
    if (done != Scaled::kNotDone) {
      return look && done == Scaled::kNonFinite;
    }
    buffer.mul_(scale_);
    return look && any_nonfinite(buffer);
  }

  // A bucket found not finite: the flag set, and which of its gradients are not, with their NaN
  // and infinity counts (torch's kernels: this runs once in a broken run, not every step).
  // Bounded: what Python has not taken stops growing at ``kNonFiniteKept`` buckets.
  void note_nonfinite(c10d::GradBucket& bucket) {
    flag_.data_ptr<int64_t>()[0] = 1;
    if (nonfinite_.size() >= kNonFiniteKept) {
      return;
    }
    const std::vector<at::Tensor> views = bucket.getGradients();
    const auto params = bucket.getParameters();
    std::vector<std::tuple<int64_t, int64_t, int64_t>> bad;
    for (size_t j = 0; j < views.size() && j < params.size(); ++j) {
      const at::Tensor& view = views[j];
      if (!at::isFloatingType(view.scalar_type())) {
        continue;
      }
      const int64_t nan = at::isnan(view).sum().item<int64_t>();
      const int64_t inf = at::isinf(view).sum().item<int64_t>();
      if (nan != 0 || inf != 0) {
        bad.emplace_back(reinterpret_cast<int64_t>(params[j].unsafeGetTensorImpl()), nan, inf);
      }
    }
    nonfinite_.emplace_back(static_cast<int64_t>(bucket.getIndex()), std::move(bad));
  }

  static constexpr size_t kNonFiniteKept = 64;
  std::mutex mu_;
  std::weak_ptr<c10d::Reducer> reducer_;  // (the reducer owns the hook that owns this: not held)
  const int64_t world_size_;
  int64_t divisor_;
  at::Tensor scale_;
  std::unique_ptr<GradWatch> watch_;
  at::Tensor flag_;  // (undefined: non-finite buckets are not looked for)
  std::vector<std::tuple<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t>>>> nonfinite_;
};

}  // namespace
