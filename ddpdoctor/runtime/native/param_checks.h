// The sampled checks' per-parameter reads: a sampled step's gradient arrivals (``ParamSample``)
// and every training forward's requires_grad check (``same_requires_grad``).
//
// On sampled steps the checks want, per reduced parameter, whether its gradient arrived and when
// (unused parameters; the bucket what-if's per-parameter ready times). Python's
// register_post_accumulate_grad_hook would do, but a tensor keeps the C++ hook that calls its
// Python hooks for good once one was registered: after the first sample, every backward took the
// GIL once per parameter to call an empty dict of hooks (about 0.6 us a parameter here). This puts
// a C++ pre-hook on each parameter's gradient accumulator (the node DDP itself hooks) when a
// sample begins and takes it off when the sample ends: nothing is left behind, no GIL is taken.
// The instant is when the gradient reaches the accumulator (before it is added to .grad).
//
// Python twin: ddpdoctor/runtime/checks/sampled.py SampledChecks (its post-accumulate-grad hooks,
// and its per-parameter requires_grad read). Parity tests:
// tests/test_sample_hooks.py::test_a_sample_leaves_no_hook_and_sees_what_python_hooks_see,
// tests/test_native_hook.py::test_same_requires_grad_reads_every_flag.
// Twin kept: SampledChecks runs where the extension is not loaded (a GPU job's Python route, no
// compiler); the Python hooks are its only way to see the arrivals there.

#pragma once

#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "accumulator_hooks.h"
#include "clock.h"
#include "fastcall.h"

namespace {

struct Arrivals {
  std::mutex mu;
  std::vector<int64_t> at;  // per parameter given: ns of the last arrival, 0 until one
};

class ArrivalStamp : public UntracedPreHook {
 public:
  ArrivalStamp(std::shared_ptr<Arrivals> arrivals, size_t slot) : arrivals_(std::move(arrivals)), slot_(slot) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    const int64_t t = now_ns();
    std::lock_guard<std::mutex> lock(arrivals_->mu);
    arrivals_->at[slot_] = t;
    return grads;
  }

 private:
  std::shared_ptr<Arrivals> arrivals_;
  size_t slot_;
};

// One sample: the hooks it added (node, hook) and what they saw. ``end`` (or the destructor)
// takes every hook off again.
class ParamSample {
 public:
  explicit ParamSample(const std::vector<at::Tensor>& params) : arrivals_(std::make_shared<Arrivals>()) {
    arrivals_->at.assign(params.size(), 0);
    hooked_.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.defined() || !p.requires_grad() || !p.is_leaf()) {
        continue;  // no accumulator: never seen (Python gives only leaves requiring grad)
      }
      auto node = torch::autograd::impl::grad_accumulator(p);
      if (!node) {
        continue;
      }
      auto hook = std::make_unique<ArrivalStamp>(arrivals_, i);
      torch::autograd::FunctionPreHook* raw = hook.get();
      node->add_pre_hook(std::move(hook));
      hooked_.emplace_back(std::move(node), raw);
    }
  }

  ~ParamSample() {
    remove();
  }

  ParamSample(const ParamSample&) = delete;
  ParamSample& operator=(const ParamSample&) = delete;

  // Takes the hooks off and returns, per parameter given, the last arrival (ns, plus ``offset``),
  // None where none came. Idempotent: a second call returns what the first saw.
  py::list end(int64_t offset) {
    remove();
    std::vector<int64_t> at;
    {
      std::lock_guard<std::mutex> lock(arrivals_->mu);
      at = arrivals_->at;
    }
    py::list out(at.size());
    for (size_t i = 0; i < at.size(); ++i) {
      out[i] = at[i] != 0 ? py::object(py::int_(at[i] + offset)) : py::object(py::none());
    }
    return out;
  }

 private:
  void remove() {
    for (auto& [node, raw] : hooked_) {
      auto& hooks = node->pre_hooks();
      for (auto it = hooks.begin(); it != hooks.end(); ++it) {
        if (it->get() == raw) {
          hooks.erase(it);
          break;
        }
      }
    }
    hooked_.clear();
  }

  using NodePtr = std::decay_t<decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()))>;
  std::shared_ptr<Arrivals> arrivals_;
  std::vector<std::pair<NodePtr, torch::autograd::FunctionPreHook*>> hooked_;
};

// Whether each tensor's requires_grad is the byte ``expected`` holds for it (1: True): the check
// of every training forward (SampledChecks) in one call, no Python attribute read per parameter.
// False as well for a length mismatch or an item that is not a tensor (Python then reads them).
bool same_requires_grad(const py::list& tensors, const py::bytes& expected) {
  char* flags = nullptr;
  Py_ssize_t n = 0;
  if (PyBytes_AsStringAndSize(expected.ptr(), &flags, &n) != 0) {
    throw py::error_already_set();
  }
  if (n != static_cast<Py_ssize_t>(PyList_GET_SIZE(tensors.ptr()))) {
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyList_GET_ITEM(tensors.ptr(), i);
    if (!THPVariable_Check(obj) || THPVariable_Unpack(obj).requires_grad() != (flags[i] != 0)) {
      return false;
    }
  }
  return true;
}

// same_requires_grad(tensors, expected)
PyObject* raw_same_requires_grad(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("same_requires_grad(tensors, expected)", n, 2);
    if (!PyList_Check(args[0]) || !PyBytes_Check(args[1])) {
      throw py::type_error("same_requires_grad(tensors, expected): a list and bytes");
    }
    return py::object(py::bool_(same_requires_grad(py::reinterpret_borrow<py::list>(args[0]),
                                                   py::reinterpret_borrow<py::bytes>(args[1]))));
  });
}

}  // namespace
