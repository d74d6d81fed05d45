// The optimizer step's start and end.
//
// torch's global optimizer step pre- and post-hooks, as C++ callables: each call stamps the
// monotonic clock into a short log that Python takes at the monitor's next forward, where the
// same rule as before decides which step the stamps belong to (StepRecorder.optimizer_start and
// optimizer_end, given the instants). So the optimizer step costs no Python entry: two of the
// four a step took on the training thread, each paying for caches the optimizer left cold.
// The log keeps the first kOptEvents events since the last take (the rule uses the first start
// and end after the backward); ``running`` (a start without its end: the hang watchdog's
// "optimizer" phase) is read without taking.
//
// Python twin: ddpdoctor/runtime/step/recorder.py StepRecorder.optimizer_start / optimizer_end
// (the rule ``take_into`` applies to the common case). Parity tests:
// tests/test_native_hook.py::test_optimizer_stamps_set_the_common_case_as_the_python_rule_does,
// tests/test_hot_path_units.py::test_optimizer_hooks_in_cpp_stamp_without_python_and_go_when_unwatched.
// Twin kept: Python's rule places every case ``take_into`` returns (an end before any start, a
// start without its end) and every stamp of the Python route.

#pragma once

#include <torch/extension.h>
#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <utility>

#include "clock.h"
#include "slots.h"
#include "fastcall.h"

namespace {

// The step's first bucket-ready instant (host ns + offset), from its ``ready`` list (ints, None
// for a bucket not seen) or, where the routine forward packed them, its ``packed`` marks; false
// when it has none.
bool earliest_ready(const py::object& ready, const py::object& packed, int64_t* out) {
  bool any = false;
  auto take = [&](int64_t v) {
    if (!any || v < *out) {
      *out = v;
    }
    any = true;
  };
  if (PyList_Check(ready.ptr())) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ready.ptr()); ++i) {
      PyObject* mark = PyList_GET_ITEM(ready.ptr(), i);
      if (PyLong_CheckExact(mark)) {
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(mark, &overflow);
        if (overflow == 0 && !(v == -1 && PyErr_Occurred())) {
          take(v);
        }
      }
    }
  }
  if (!any && PyBytes_Check(packed.ptr())) {
    const Py_ssize_t fields = kPackedFields;
    const Py_ssize_t count = PyBytes_GET_SIZE(packed.ptr()) / (fields * static_cast<Py_ssize_t>(sizeof(int64_t)));
    const auto* marks = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(packed.ptr()));
    for (Py_ssize_t i = 0; i < count; ++i) {
      take(marks[i * fields]);
    }
  }
  return any;
}

class OptimizerStamps {
 public:
  static constexpr size_t kOptEvents = 16;

  void stamp(bool start) {
    const int64_t t = now_ns();
    std::lock_guard<std::mutex> lock(mu_);
    running_ = start;
    if (n_ < kOptEvents) {
      events_[n_++] = {start, t};
    }
  }

  // The events since the last take, oldest first, as (start, host ns + offset); None: none.
  py::object take(int64_t offset) {
    Events events;
    return as_list(events, take_events(events), offset);
  }

  // ``take``, with the common case applied to ``step`` (the open OpenStep, or None) here, and
  // None returned: on a step that has buckets and no optimizer marks yet, the first start stamped
  // after its first bucket was ready, then the end that closes it (past the starts and ends of
  // optimizer steps run inside it: ZeroRedundancyOptimizer steps its local optimizer), become its
  // opt_start and opt_end (what StepRecorder.optimizer_start and optimizer_end do with the same
  // instants).
  // Events stamped before the step's first bucket was ready are another optimizer's, one that
  // stepped between this model's forward and its backward (two models in one process): the rule
  // passes over them, as the live Python hooks do, and so does this. Anything else (an end before
  // any start: a closure's optimizer step; a start without its end) is returned as ``take``
  // returns it, for Python's rule.
  py::object take_into(py::handle step, int64_t offset) {
    static PyObject* const ready_name = PyUnicode_InternFromString("ready");
    static PyObject* const packed_name = PyUnicode_InternFromString("packed");
    static PyObject* const start_name = PyUnicode_InternFromString("opt_start");
    static PyObject* const end_name = PyUnicode_InternFromString("opt_end");
    Events events;
    const size_t n = take_events(events);
    if (n >= 2 && !step.is_none()) {
      auto get = [&step](PyObject* name) { return get_attr(step, name); };
      int64_t first_ready = 0;
      const bool any = earliest_ready(get(ready_name), get(packed_name), &first_ready);
      if (any && get(start_name).is_none() && get(end_name).is_none()) {
        size_t i = 0;
        while (i < n && events[i].second + offset < first_ready) {
          ++i;  // before the step's first bucket: another model's optimizer
        }
        size_t j = i + 1;
        for (int depth = 1; j < n; ++j) {
          depth += events[j].first ? 1 : -1;
          if (depth == 0) {
            break;  // the end of the first start's step
          }
        }
        if (i < n && events[i].first && j < n) {
          py::int_ start(events[i].second + offset);
          py::int_ end(events[j].second + offset);
          set_attr(step, start_name, start.ptr());
          set_attr(step, end_name, end.ptr());
          return py::none();
        }
      }
    }
    return as_list(events, n, offset);
  }

  bool running() {
    std::lock_guard<std::mutex> lock(mu_);
    return running_;
  }

 private:
  using Events = std::array<std::pair<bool, int64_t>, kOptEvents>;

  // Moves the events logged since the last take into ``out``; how many.
  size_t take_events(Events& out) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t n = n_;
    std::copy(events_.begin(), events_.begin() + n, out.begin());
    n_ = 0;
    return n;
  }

  // The first ``n`` events as (start, host ns + offset) tuples; None when there are none.
  static py::object as_list(const Events& events, size_t n, int64_t offset) {
    if (n == 0) {
      return py::none();
    }
    py::list out(n);
    for (size_t i = 0; i < n; ++i) {
      out[i] = py::make_tuple(py::bool_(events[i].first), py::int_(events[i].second + offset));
    }
    return std::move(out);
  }

  std::mutex mu_;
  Events events_{};
  size_t n_ = 0;
  bool running_ = false;
};

// OptimizerStamps.pre / post(*args): torch calls them as hook(optimizer, args, kwargs); nothing
// is read from the arguments. (Guarded too: a C++ exception must never leave a C function.)
PyObject* raw_stamp_start(PyObject* self, PyObject* const*, Py_ssize_t) {
  return guarded([&] {
    held<OptimizerStamps>(self).stamp(true);
    return py::none();
  });
}

PyObject* raw_stamp_end(PyObject* self, PyObject* const*, Py_ssize_t) {
  return guarded([&] {
    held<OptimizerStamps>(self).stamp(false);
    return py::none();
  });
}

// OptimizerStamps.take_into(step, offset)
PyObject* raw_take_into(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("take_into(step, offset)", n, 2);
    return held<OptimizerStamps>(self).take_into(args[0], int_arg(args[1]));
  });
}

PyMethodDef kStampStart = {"pre", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_stamp_start)),
                           METH_FASTCALL, "an optimizer step's start (torch's global optimizer pre-hook)"};
PyMethodDef kStampEnd = {"post", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_stamp_end)),
                         METH_FASTCALL, "an optimizer step's end (torch's global optimizer post-hook)"};
PyMethodDef kTakeInto = {"take_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_take_into)),
                         METH_FASTCALL,
                         "take_into(step, offset): the stamps since the last take set on the step (None), or "
                         "returned as take returns them"};

}  // namespace
