// What the C++ pre-hooks on gradient accumulators share: ``UntracedPreHook``, which compiled
// autograd leaves out, and ``NodeRef``/``Unowned``, an accumulator's owning pointer and one that
// does not own it. Used by the per-parameter arrival stamps (param_checks.h) and by DdpScale's
// record of which gradients stay their bucket's view (ddp_scale.h).
//
// No Python twin: Python's hooks (register_post_accumulate_grad_hook) are traced by compiled
// autograd and need none of this.

#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <memory>
#include <type_traits>

namespace {

// A pre-hook on a gradient accumulator that compiled autograd leaves out. Compiled autograd collects
// the hooks of the graph it traces and raises on a C++ hook that cannot say how to trace it, even
// where it is enabled only around the backward (``compiled_autograd._enable``), after the forward
// that added the hook looked: a hook of this kind simply does not run in a compiled backward.
// (torch 2.6 made the method const: both spellings, one of which overrides.)
class UntracedPreHook : public torch::autograd::FunctionPreHook {
 public:
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) {}
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const {}
};

// A gradient accumulator's owning pointer, and a pointer to it that does not own it: torch 2.5's
// nodes are shared_ptr-managed, 2.13's intrusive_ptr-managed.
using NodeRef = std::decay_t<decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()))>;
template <typename P>
struct Unowned;
template <typename T>
struct Unowned<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <typename T, typename N>
struct Unowned<c10::intrusive_ptr<T, N>> {
  using type = c10::weak_intrusive_ptr<T, N>;
};

}  // namespace
