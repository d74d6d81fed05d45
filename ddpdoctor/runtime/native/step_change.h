// A new step, and the routine forward's change of step, built here.
//
// ``step_opener(OpenStep)``: a function ``open(index, t0, offset, synced)`` that returns what
// ``OpenStep(index, t0)`` does (step/recorder.py), with ``fwd_start = t0`` and
// ``synced_forward = True`` where ``synced``: the routine forward's new step. The slots are written
// at their offsets (read once from the class's slot descriptors), with no Python frame and no
// attribute lookup: OpenStep.__init__ is 25 lines, run cold once a step. ``t0_mono_ns`` and
// ``t0_wall_ns`` are read here on the same clocks (perf_counter's CLOCK_MONOTONIC, time_ns's
// CLOCK_REALTIME), plus ``offset`` (the tests' shifted clock, as clocks.mono_ns adds it).
//
// ``step_changer(timing, stamps, cls)``: a function ``change(step, index, offset, same_bytes)`` for
// the routine forward (StepHooks.on_forward_pre), doing what its calls did one after the other: the
// ring's marks into ``step`` (drain_packed), the optimizer's stamps (take_into), ``step`` ended now
// (an optimizer step whose closure runs this forward keeps no start: it is still running), and the
// next step opened at the same instant (an OpenStep ``cls``, as step_opener's, synchronizing).
// Returns the new OpenStep. Where the drain gives columns (out of order) or the stamps their events
// (not the common case), returns them at once (a tuple, a list), nothing ended or opened: the full
// path goes on from there. Each call after the backward costs a cold entry; this is one.
//
// Python twin: ddpdoctor/runtime/step/recorder.py OpenStep.__init__ and StepRecorder.forward_start,
// the full path of ddpdoctor/runtime/step/hooks.py StepHooks.on_forward_pre. Parity tests:
// tests/test_native_hook.py::test_step_opener_builds_the_step_python_builds,
// tests/test_routine_forward.py::test_the_routine_forward_writes_what_the_full_path_writes.
// Twin kept: the full path runs every forward that is not routine, and every forward of the
// Python route.

#pragma once

#include <torch/extension.h>
#include <cstdint>
#include <memory>
#include <utility>

#include "clock.h"
#include "slots.h"
#include "fastcall.h"
#include "comm_hook.h"
#include "drain.h"
#include "optimizer.h"

namespace {

// A new OpenStep(index, t0) of the slots ``s``, its t0_mono_ns ``mono`` (the wall clock read here).
py::object open_step(const StepSlots& s, PyObject* index, PyObject* t0, int64_t mono, int64_t offset, bool synced) {
  const int64_t wall = wall_now_ns() + offset;
  py::object step = py::reinterpret_steal<py::object>(s.cls->tp_alloc(s.cls, 0));
  if (!step) {
    throw py::error_already_set();
  }
  PyObject* o = step.ptr();
  put(o, s.index, Py_NewRef(index));
  put(o, s.t0, Py_NewRef(t0));
  put(o, s.t0_mono_ns, PyLong_FromLongLong(mono));
  put(o, s.t0_wall_ns, PyLong_FromLongLong(wall));
  put(o, s.micro, PyLong_FromLong(0));
  put(o, s.fwd_start, Py_NewRef(synced ? t0 : Py_None));
  put(o, s.fwd_end, Py_NewRef(Py_None));
  put(o, s.bcast, PyList_New(0));
  put(o, s.bcast_bytes, PyLong_FromLong(0));
  put(o, s.bwd_end, Py_NewRef(Py_None));
  put(o, s.ready, PyList_New(0));
  put(o, s.launch, PyList_New(0));
  put(o, s.done, PyList_New(0));
  put(o, s.nbytes, PyList_New(0));
  put(o, s.opt_start, Py_NewRef(Py_None));
  put(o, s.opt_end, Py_NewRef(Py_None));
  put(o, s.end, Py_NewRef(Py_None));
  put(o, s.synced_forward, Py_NewRef(synced ? Py_True : Py_False));
  put(o, s.layout, Py_NewRef(Py_None));
  put(o, s.comm_hook, Py_NewRef(Py_None));
  put(o, s.all_marks, Py_NewRef(Py_True));
  put(o, s.arrived, PyLong_FromLong(0));
  put(o, s.done_seen, PyList_New(0));
  put(o, s.sync, Py_NewRef(Py_None));
  put(o, s.packed, Py_NewRef(Py_None));
  return step;
}

PyObject* raw_open_step(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("open(index, t0, offset, synced)", n, 4);
    const int64_t offset = int_arg(args[2]);
    const int synced = PyObject_IsTrue(args[3]);
    if (synced < 0) {
      throw py::error_already_set();
    }
    return open_step(held<StepSlots>(self), args[0], args[1], now_ns() + offset, offset, synced != 0);
  });
}

PyMethodDef kOpenStep = {"open", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_open_step)),
                         METH_FASTCALL,
                         "open(index, t0, offset, synced): a new OpenStep, as OpenStep(index, t0) builds it (with "
                         "fwd_start = t0 and synced_forward = True where synced)"};

// ``open(index, t0, offset, synced)`` for ``cls``: the step ``step_changer`` opens, built alone (its
// test compares every slot with OpenStep.__init__'s).
py::object step_opener(py::handle cls_handle) {
  return bound(&kOpenStep, step_slots(cls_handle));
}

struct StepChange {
  std::shared_ptr<Ring> ring;
  std::shared_ptr<OptimizerStamps> stamps;
  std::shared_ptr<StepSlots> slots;
};

PyObject* raw_change_step(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  static PyObject* const start_name = PyUnicode_InternFromString("opt_start");
  static PyObject* const end_name = PyUnicode_InternFromString("opt_end");
  static PyObject* const step_end_name = PyUnicode_InternFromString("end");
  return guarded([&] {
    expect_args("change(step, index, offset, same_bytes)", n, 4);
    const StepChange& c = held<StepChange>(self);
    py::handle step = args[0];
    const int64_t offset = int_arg(args[2]);
    py::object columns = drain_packed(*c.ring, step, offset, args[3]);
    if (!columns.is_none()) {
      return columns;
    }
    py::object events = c.stamps->take_into(step, offset);
    if (!events.is_none()) {
      return events;
    }
    py::object start = get_attr(step, start_name);
    if (!start.is_none()) {  // (StepRecorder.forward_start's rule for a closure's optimizer step)
      py::object end = get_attr(step, end_name);
      if (end.is_none()) {
        set_attr(step, start_name, Py_None);
      }
    }
    const int64_t now = now_ns() + offset;
    py::object at = py::reinterpret_steal<py::object>(PyLong_FromLongLong(now));
    set_attr(step, step_end_name, at.ptr());
    return open_step(*c.slots, args[1], at.ptr(), now, offset, true);
  });
}

PyMethodDef kChangeStep = {"change", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_change_step)),
                           METH_FASTCALL,
                           "change(step, index, offset, same_bytes): the routine forward's step change (the new "
                           "OpenStep), or the drain's columns or the optimizer's events, nothing changed"};

py::object step_changer(Handle& timing, std::shared_ptr<OptimizerStamps> stamps, py::handle cls) {
  if (!stamps) {
    throw py::type_error("step_changer: no optimizer stamps");
  }
  auto change = std::make_shared<StepChange>();
  change->ring = timing.ring;
  change->stamps = std::move(stamps);
  change->slots = step_slots(cls);
  return bound(&kChangeStep, std::move(change));
}

}  // namespace
