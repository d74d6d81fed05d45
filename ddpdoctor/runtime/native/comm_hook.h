// The comm hook and its ring: a DDP comm hook that does what DDP does without a hook (scale the
// bucket as DDP would, see DdpScale in ddp_scale.h; sum it across ranks) and stamps three instants
// per bucket on the monotonic clock: ready (the reducer hands the bucket over), launch (the
// all-reduce is enqueued) and done (the all-reduce completed, stamped on the comm library's
// thread). Each bucket's stamps go into a fixed-size ring that Python drains once per step
// (drain.h).
//
// Why C++: a Python comm hook costs a C++->Python call per bucket and a Python callback on the
// comm thread (GIL hand-offs); on short steps that is ~15% of the step. Nothing here takes the
// GIL on the comm thread, and nothing allocates per bucket once the ring exists.
//
// The backward's compute end is stamped here too: the first bucket of a backward queues an
// autograd final callback, which runs once the graph is done, before DDP's own finalization
// (which waits for the all-reduces). Nothing is hooked on the forward's output, and the backward
// takes no GIL: Python drains the ring at its next hook of the step (the next forward's, close),
// which runs anyway.
//
// Python twin: ddpdoctor/runtime/step/comm_hook.py (timed_hook, mean_allreduce): the Python route.
// Parity tests: tests/test_native_hook.py::test_native_timing_every_bucket_every_step_and_identical_losses
// and ::test_native_env_zero_takes_the_python_route (the same marks and losses on both routes).
// Twin kept: the Python route times what this cannot: CUDA models (event marks), a hook
// registered before ``instrument``, hosts without a compiler.

#pragma once

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "clock.h"
#include "ddp_scale.h"

namespace {

// torch 2.13+ stashes the Python contextvars Context in the thread-local state for the length of
// a backward, and gloo's work copies the thread-local state. A gloo thread that drops the last
// reference to that Context needs the GIL (at interpreter exit: the process aborts). The
// all-reduce is therefore enqueued with the Context taken out of the thread-local state, then
// put back. Torch versions without ThreadLocalPythonObjects::erase stash nothing: a no-op there.
template <typename T, typename = void>
struct HasErase : std::false_type {};
template <typename T>
struct HasErase<T, std::void_t<decltype(T::erase(std::declval<const std::string&>()))>> : std::true_type {};

template <typename T>
class WithoutBackwardContext {
 public:
  WithoutBackwardContext() {
    if constexpr (HasErase<T>::value) {
      if (T::contains(key())) {
        saved_ = T::get(key());
        T::erase(key());
      }
    }
  }
  ~WithoutBackwardContext() {
    if constexpr (HasErase<T>::value) {
      if (saved_) {
        T::set(key(), std::move(saved_));
      }
    }
  }
  WithoutBackwardContext(const WithoutBackwardContext&) = delete;
  WithoutBackwardContext& operator=(const WithoutBackwardContext&) = delete;

 private:
  static const std::string& key() {
    static const std::string k = "context";
    return k;
  }
  std::shared_ptr<c10::SafePyObject> saved_;
};

struct Entry {
  int64_t index = -1;
  int64_t ready = 0;
  int64_t launch = 0;
  int64_t done = 0;  // 0 until the all-reduce completed
  int64_t bytes = 0;
  uint64_t seq = 0;  // which write this slot holds (a late completion of an overwritten slot is dropped)
};

// Fixed capacity, allocated once. The training thread writes ready/launch, a comm thread writes
// done, the training thread drains; a mutex held for a few stores keeps them apart (uncontended:
// tens of ns, no GIL).
class Ring {
 public:
  explicit Ring(size_t capacity) : slots_(capacity) {}

  // A new bucket: its slot's sequence number (0: not recorded).
  uint64_t begin(int64_t index, int64_t ready, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_) {
      return 0;
    }
    if (head_ - tail_ >= slots_.size()) {
      ++tail_;  // full (nobody drains): the oldest entry goes, memory stays bounded
      ++dropped_;
    }
    uint64_t seq = ++head_;  // sequence numbers start at 1
    Entry& e = slots_[seq % slots_.size()];
    e.index = index;
    e.ready = ready;
    e.launch = 0;
    e.done = 0;
    e.bytes = bytes;
    e.seq = seq;
    return seq;
  }

  void launched(uint64_t seq, int64_t t) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = slots_[seq % slots_.size()];
    if (e.seq == seq) {
      e.launch = t;
    }
  }

  void done(uint64_t seq, int64_t t) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = slots_[seq % slots_.size()];
    if (e.seq == seq) {
      e.done = t;
    }
  }

  // Every entry written since the last drain, in order, into ``out`` (no allocation for up to its
  // inline size); done is 0 for an all-reduce still in flight. The entries stay: a look at the
  // buckets of a backward still in progress (the hang watchdog's).
  template <typename Out>
  void peek(Out& out) {
    std::lock_guard<std::mutex> lock(mu_);
    copy(out);
  }

  // ``peek`` and the backward end, under one lock, both taken: the ring is empty afterwards and
  // the backward end 0 (returned; 0: not stamped). The drain of every step (``drain_into``).
  template <typename Out>
  int64_t take(Out& out) {
    std::lock_guard<std::mutex> lock(mu_);
    copy(out);
    tail_ = head_;
    const int64_t t = backward_end_;
    backward_end_ = 0;
    return t;
  }

  // The parameters (TensorImpl addresses, Python's Tensor._cdata) of each bucket seen while
  // layout capture was on; captured only at the steps Python asks for (the first ones).
  void want_layout(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    want_layout_ = on;
  }

  bool wants_layout() {
    std::lock_guard<std::mutex> lock(mu_);
    return want_layout_;
  }

  void add_layout(int64_t index, std::vector<int64_t> params) {
    std::lock_guard<std::mutex> lock(mu_);
    layout_.emplace_back(index, std::move(params));
  }

  std::vector<std::tuple<int64_t, std::vector<int64_t>>> take_layout() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::tuple<int64_t, std::vector<int64_t>>> out;
    out.swap(layout_);
    return out;
  }

  void set_enabled(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    enabled_ = on;
  }

  uint64_t dropped() {
    std::lock_guard<std::mutex> lock(mu_);
    return dropped_;
  }

  // Backward compute end, stamped by an autograd final callback that the first bucket of each
  // graph task (each backward, and each reentrant one inside it) queues: ``queue_end`` says
  // whether ``task`` has its callback queued already, ``end`` stamps (the last callback wins: an
  // outer backward ends after the reentrant ones inside it). Off (``stamp_ends``) where Python
  // stamps the backward end itself (compiled autograd may trace the graph).
  bool queue_end(int64_t task) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stamp_ends_ || task == queued_task_) {
      return false;
    }
    queued_task_ = task;
    return true;
  }

  void end(int64_t t) {
    std::lock_guard<std::mutex> lock(mu_);
    backward_end_ = t;
  }

  void stamp_ends(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    stamp_ends_ = on;
  }

  // The backward end stamped and not drained yet (0: none); read only.
  int64_t backward_end() {
    std::lock_guard<std::mutex> lock(mu_);
    return backward_end_;
  }

  size_t capacity() const {
    return slots_.size();
  }

 private:
  template <typename Out>
  void copy(Out& out) {  // (mu_ held)
    for (uint64_t seq = tail_ + 1; seq <= head_; ++seq) {
      out.push_back(slots_[seq % slots_.size()]);
    }
  }

  std::mutex mu_;
  std::vector<Entry> slots_;
  uint64_t head_ = 0;  // last sequence number written
  uint64_t tail_ = 0;  // last sequence number drained
  uint64_t dropped_ = 0;
  bool enabled_ = true;
  bool want_layout_ = false;
  bool stamp_ends_ = true;
  int64_t queued_task_ = -1;  // the graph task whose backward-end callback was queued last
  int64_t backward_end_ = 0;
  std::vector<std::tuple<int64_t, std::vector<int64_t>>> layout_;
};

// A Python hook to hand every bucket to instead: a user's hook registered after this one, timed
// by ddpdoctor's Python comm hook (the reducer takes one hook, so this one passes them on). Kept
// apart from the ring: completion callbacks on the comm thread hold the ring, never this, so no
// Python object is ever released there.
class Delegate {
 public:
  void set(std::shared_ptr<c10d::PythonCommHook> hook) {
    std::lock_guard<std::mutex> lock(mu_);
    hook_ = std::move(hook);
  }

  std::shared_ptr<c10d::PythonCommHook> get() {
    std::lock_guard<std::mutex> lock(mu_);
    return hook_;
  }

 private:
  std::mutex mu_;
  std::shared_ptr<c10d::PythonCommHook> hook_;
};

// What Python holds: the ring and the delegate slot the hook on the reducer shares.
struct Handle {
  std::shared_ptr<Ring> ring;
  std::shared_ptr<Delegate> delegate;
};

class TimedAllReduceHook
    : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  TimedAllReduceHook(
      const c10::intrusive_ptr<c10d::ProcessGroup>& group,
      std::shared_ptr<Ring> ring,
      std::shared_ptr<Delegate> delegate,
      std::shared_ptr<DdpScale> scale)
      : c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>>(group),
        ring_(std::move(ring)),
        delegate_(std::move(delegate)),
        scale_(std::move(scale)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    const int64_t ready = now_ns();
    if (auto delegate = delegate_->get()) {
      return delegate->runHook(bucket);  // takes the GIL itself, as DDP's Python hooks do
    }
    at::Tensor& buffer = bucket.getBufferRef();
    const auto index = static_cast<int64_t>(bucket.getIndex());
    const uint64_t seq = ring_->begin(index, ready, static_cast<int64_t>(buffer.numel() * buffer.element_size()));
    if (seq != 0 && ring_->wants_layout()) {
      std::vector<int64_t> params;
      for (const auto& p : bucket.getParameters()) {
        params.push_back(reinterpret_cast<int64_t>(p.unsafeGetTensorImpl()));
      }
      ring_->add_layout(index, std::move(params));
    }
    // with a hook registered DDP copies the gradients unscaled: scaled here as it would have
    scale_->apply(bucket);
    std::vector<at::Tensor> tensors = {buffer};
    WithoutBackwardContext<at::impl::ThreadLocalPythonObjects> no_context;
    auto fut = state_->allreduce(tensors)->getFuture();
    if (seq == 0) {
      return fut;
    }
    ring_->launched(seq, now_ns());
    std::shared_ptr<Ring> ring = ring_;
    // The first bucket of a backward queues the callback that stamps its compute end. Queued
    // now, it runs before DDP's finalize_backward, which DDP queues once its last bucket is
    // launched (after this). Outside a backward (a joined rank's shadow all-reduce under Join)
    // there is no graph task and nothing is queued.
    const int64_t task = torch::autograd::get_current_graph_task_id();
    if (task >= 0 && ring->queue_end(task)) {
      torch::autograd::Engine::get_default_engine().queue_callback([ring]() { ring->end(now_ns()); });
    }
    // Runs on the comm library's thread when the all-reduce completes; DDP waits on the returned
    // future, so every done stamp is written before DDP's finalize_backward returns.
    return fut->then(
        [ring, seq](c10::ivalue::Future& f) -> c10::IValue {
          ring->done(seq, now_ns());
          return f.value();
        },
        fut->elementType());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isPyObject()) {
      if (auto delegate = delegate_->get()) {
        return delegate->parseHookResult(result);
      }
    }
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  std::shared_ptr<Ring> ring_;
  std::shared_ptr<Delegate> delegate_;
  const std::shared_ptr<DdpScale> scale_;
};

// Registers the timed hook on DDP's reducer; the reducer owns it from then on (a reducer takes
// one hook, for good: a later hook is handed the buckets through Ring::delegate). Raises DDP's
// own "can only be called once" error if a hook is registered already. ``scale`` (None: one that
// watches no gradient) scales each bucket as DDP would.
Handle register_timed_hook(
    const std::shared_ptr<c10d::Reducer>& reducer,
    const c10::intrusive_ptr<c10d::ProcessGroup>& group,
    int64_t capacity,
    std::shared_ptr<DdpScale> scale) {
  TORCH_CHECK(capacity > 0, "ring capacity must be positive");
  if (scale == nullptr) {  // (the benches': DDP's divisor, gradients taken as copied)
    scale = std::make_shared<DdpScale>(reducer, group->getSize(), std::vector<at::Tensor>{}, false);
  }
  Handle handle{std::make_shared<Ring>(static_cast<size_t>(capacity)), std::make_shared<Delegate>()};
  reducer->register_comm_hook(std::make_unique<TimedAllReduceHook>(group, handle.ring, handle.delegate, std::move(scale)));
  return handle;
}

// Whether pybind takes these objects as a reducer and a process group here (checked at attach,
// before anything is registered, so a mismatch means the Python route from the start).
bool accepts(const std::shared_ptr<c10d::Reducer>& reducer, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return reducer != nullptr && group.defined();
}

}  // namespace
