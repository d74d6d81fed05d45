// The step record, built in C++.
//
// StepRecorder._emit_step's host-clock branch, for the steps emitted together on short steps: the
// same arithmetic on the same doubles (offsets from t0 as (mark - t0) / 1000.0, sums in order), so
// the record is equal field for field to the one Python builds. In Python this was most of the
// step record's cost: a list comprehension per bucket column and a dozen attribute reads, on every
// step.
//
// Python twin: ddpdoctor/runtime/step/recorder.py StepRecorder._emit_step (with unpack_marks for
// packed marks). Parity test: tests/test_step_build.py (random steps, packed marks, a real run).
// Twin kept: Python builds every CUDA-clock step (device marks) and every record where the
// extension is not loaded.

#pragma once

#include <torch/extension.h>
#include <cstdint>
#include <limits>

#include "column.h"
#include "slots.h"
#include "fastcall.h"

namespace {

struct StepNames {
  PyObject* index;
  PyObject* t0;
  PyObject* t0_mono_ns;
  PyObject* t0_wall_ns;
  PyObject* micro;
  PyObject* fwd_start;
  PyObject* fwd_end;
  PyObject* bcast;
  PyObject* bcast_bytes;
  PyObject* bwd_end;
  PyObject* ready;
  PyObject* launch;
  PyObject* done;
  PyObject* nbytes;
  PyObject* opt_start;
  PyObject* opt_end;
  PyObject* end;
  PyObject* packed;
  PyObject* kwnames;  // the Step fields passed, in the order of the arguments below
};

constexpr Py_ssize_t kStepFields = 22;

const StepNames& step_names() {
  static const StepNames names = [] {
    auto intern = [](const char* s) { return PyUnicode_InternFromString(s); };
    StepNames n{};
    n.index = intern("index");
    n.t0 = intern("t0");
    n.t0_mono_ns = intern("t0_mono_ns");
    n.t0_wall_ns = intern("t0_wall_ns");
    n.micro = intern("micro");
    n.fwd_start = intern("fwd_start");
    n.fwd_end = intern("fwd_end");
    n.bcast = intern("bcast");
    n.bcast_bytes = intern("bcast_bytes");
    n.bwd_end = intern("bwd_end");
    n.ready = intern("ready");
    n.launch = intern("launch");
    n.done = intern("done");
    n.nbytes = intern("nbytes");
    n.opt_start = intern("opt_start");
    n.opt_end = intern("opt_end");
    n.end = intern("end");
    n.packed = intern("packed");
    const char* fields[kStepFields] = {
        "rank",       "ddp",        "step",       "t0_mono_ns", "t0_wall_ns",  "micro",
        "fwd_start_us", "fwd_us",   "bcast_start_us", "bcast_us", "bcast_bytes", "fwd_end_us",
        "bwd_end_us", "b_ready_us", "b_launch_us", "b_done_us", "b_bytes",     "sync_end_us",
        "opt_start_us", "opt_end_us", "end_us",   "clock"};
    n.kwnames = PyTuple_New(kStepFields);
    for (Py_ssize_t i = 0; i < kStepFields; ++i) {
      PyTuple_SET_ITEM(n.kwnames, i, intern(fields[i]));
    }
    return n;
  }();
  return names;
}

// A host mark (a Python int of ns) as an integer.
int64_t as_ns(PyObject* mark) {
  const int64_t ns = PyLong_AsLongLong(mark);
  if (ns == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return ns;
}

// A host mark (a Python int of ns, or None) as µs from t0: a new reference (None for None).
py::object rel_us(int64_t t0, PyObject* mark) {
  if (mark == Py_None) {
    return py::none();
  }
  return py::float_(static_cast<double>(as_ns(mark) - t0) / 1000.0);
}

// ``rel_us`` of each mark of a list (the bucket columns), as a new Column; ``latest`` gets the
// largest offset when no mark is None (sync_end: the last all-reduce done).
py::object rel_column(int64_t t0, PyObject* marks, py::object* latest) {
  if (!PyList_Check(marks)) {
    throw py::type_error("a step's bucket marks must be a list");
  }
  const Py_ssize_t n = PyList_GET_SIZE(marks);
  if (n == 0) {
    if (latest != nullptr) {
      *latest = py::none();
    }
    return py::list();  // (an empty column: see column.h's new_column)
  }
  ColumnObject* column = new_column(n);
  py::object out = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(column));
  bool complete = true;  // (n > 0: an empty column returned above)
  double top = 0.0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* mark = PyList_GET_ITEM(marks, i);
    if (mark == Py_None) {
      complete = false;
      column->values[i] = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    const double us = static_cast<double>(as_ns(mark) - t0) / 1000.0;
    top = (i == 0 || us > top) ? us : top;
    column->values[i] = us;
  }
  if (latest != nullptr) {
    *latest = complete ? py::object(py::float_(top)) : py::object(py::none());
  }
  return out;
}

// ``rel_column``'s three columns (ready, launch, done) from a step's packed marks (drain_packed):
// the same offsets from the same integers, so the record equals the one the lists give.
void rel_packed(int64_t t0, PyObject* packed, py::object* ready, py::object* launch, py::object* done,
                py::object* latest) {
  if (!PyBytes_Check(packed) ||
      PyBytes_GET_SIZE(packed) % (kPackedFields * static_cast<Py_ssize_t>(sizeof(int64_t))) != 0) {
    throw py::type_error("a step's packed marks must be bytes of int64 triples");
  }
  const Py_ssize_t n = PyBytes_GET_SIZE(packed) / (kPackedFields * static_cast<Py_ssize_t>(sizeof(int64_t)));
  const auto* marks = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(packed));
  py::object* columns[kPackedFields] = {ready, launch, done};
  if (n == 0) {  // (an empty column: see column.h's new_column)
    for (py::object* column : columns) {
      *column = py::list();
    }
    *latest = py::none();
    return;
  }
  bool complete = true;  // (n > 0: an empty column returned above)
  double top = 0.0;
  for (Py_ssize_t f = 0; f < kPackedFields; ++f) {
    ColumnObject* column = new_column(n);
    *columns[f] = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(column));
    for (Py_ssize_t i = 0; i < n; ++i) {
      const int64_t mark = marks[i * kPackedFields + f];
      if (mark == kPackedNone) {
        complete = false;
        column->values[i] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      const double us = static_cast<double>(mark - t0) / 1000.0;
      if (f == 2) {
        top = (i == 0 || us > top) ? us : top;
      }
      column->values[i] = us;
    }
  }
  *latest = complete ? py::object(py::float_(top)) : py::object(py::none());
}

// The Step record of a closed OpenStep whose marks are host-clock ns: ``cls(...)`` with the
// fields StepRecorder._emit_step gives it (its per-bucket lists: bytes handed over, not copied).
py::object build_step(py::handle step, py::handle cls, py::handle rank, py::handle ddp, py::handle clock) {
  const StepNames& n = step_names();
  PyObject* s = step.ptr();
  const StepSlots* slots = known_slots(Py_TYPE(s));
  auto get = [s, slots](PyObject* name, Py_ssize_t StepSlots::*offset) {
    if (slots == nullptr) {
      return py::reinterpret_steal<py::object>(PyObject_GetAttr(s, name));
    }
    PyObject* value = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(s) + slots->*offset);
    if (value == nullptr) {  // (an unset slot: as the attribute read raises)
      PyErr_SetObject(PyExc_AttributeError, name);
      return py::object();
    }
    return py::reinterpret_borrow<py::object>(value);
  };
  auto must = [](const py::object& o) {
    if (!o) {
      throw py::error_already_set();
    }
    return o.ptr();
  };
  py::object t0_obj = get(n.t0, &StepSlots::t0), fwd_start = get(n.fwd_start, &StepSlots::fwd_start);
  py::object fwd_end = get(n.fwd_end, &StepSlots::fwd_end), bwd_end = get(n.bwd_end, &StepSlots::bwd_end);
  py::object opt_start = get(n.opt_start, &StepSlots::opt_start), opt_end = get(n.opt_end, &StepSlots::opt_end);
  py::object end = get(n.end, &StepSlots::end), bcast = get(n.bcast, &StepSlots::bcast);
  py::object ready = get(n.ready, &StepSlots::ready), launch = get(n.launch, &StepSlots::launch);
  py::object done = get(n.done, &StepSlots::done), nbytes = get(n.nbytes, &StepSlots::nbytes);
  py::object index = get(n.index, &StepSlots::index), t0_mono = get(n.t0_mono_ns, &StepSlots::t0_mono_ns);
  py::object t0_wall = get(n.t0_wall_ns, &StepSlots::t0_wall_ns), micro = get(n.micro, &StepSlots::micro);
  py::object bcast_bytes = get(n.bcast_bytes, &StepSlots::bcast_bytes), packed = get(n.packed, &StepSlots::packed);
  if (PyErr_Occurred()) {
    throw py::error_already_set();  // not an OpenStep
  }
  const int64_t t0 = as_ns(must(t0_obj));
  PyObject* bcast_list = must(bcast);
  if (!PyList_Check(bcast_list)) {
    throw py::type_error("a step's broadcasts must be a list");
  }
  py::object fwd_start_us = rel_us(t0, must(fwd_start));
  if (fwd_start_us.is_none() || PyFloat_AS_DOUBLE(fwd_start_us.ptr()) == 0.0) {
    fwd_start_us = py::float_(0.0);  // Python's ``fwd_start_us or 0.0``
  }
  py::object bcast_us = py::none(), bcast_start = py::none(), fwd_us = py::none();
  const Py_ssize_t nb = PyList_GET_SIZE(bcast_list);
  double in_sync = 0.0;  // the broadcasts inside the synchronizing forward, summed in order
  if (nb > 0) {
    double total = 0.0;
    for (Py_ssize_t i = 0; i < nb; ++i) {
      PyObject* item = PyList_GET_ITEM(bcast_list, i);
      if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        throw py::type_error("a step's broadcast must be a (start, end, sync) tuple");
      }
      const double us =
          static_cast<double>(as_ns(PyTuple_GET_ITEM(item, 1)) - as_ns(PyTuple_GET_ITEM(item, 0))) / 1000.0;
      total += us;
      const int sync = PyObject_IsTrue(PyTuple_GET_ITEM(item, 2));
      if (sync < 0) {
        throw py::error_already_set();
      }
      if (sync) {
        in_sync += us;
      }
    }
    bcast_us = py::float_(total);
    bcast_start = rel_us(t0, PyTuple_GET_ITEM(PyList_GET_ITEM(bcast_list, 0), 0));
  }
  if (fwd_start.ptr() != Py_None && fwd_end.ptr() != Py_None) {
    double us = static_cast<double>(as_ns(fwd_end.ptr()) - as_ns(fwd_start.ptr())) / 1000.0;
    if (nb > 0) {
      us -= in_sync;
    }
    fwd_us = py::float_(us);
  }
  py::object sync_end;
  py::object done_us, ready_us, launch_us;
  if (must(packed) != Py_None) {  // the routine forward's drain (drain_packed): its lists are empty
    rel_packed(t0, packed.ptr(), &ready_us, &launch_us, &done_us, &sync_end);
  } else {
    done_us = rel_column(t0, must(done), &sync_end);
    ready_us = rel_column(t0, must(ready), nullptr);
    launch_us = rel_column(t0, must(launch), nullptr);
  }
  py::object args[kStepFields] = {
      py::reinterpret_borrow<py::object>(rank),
      py::reinterpret_borrow<py::object>(ddp),
      index,
      t0_mono,
      t0_wall,
      micro,
      fwd_start_us,
      fwd_us,
      bcast_start,
      bcast_us,
      bcast_bytes,
      rel_us(t0, must(fwd_end)),
      rel_us(t0, must(bwd_end)),
      ready_us,
      launch_us,
      done_us,
      nbytes,
      sync_end,
      rel_us(t0, must(opt_start)),
      rel_us(t0, must(opt_end)),
      rel_us(t0, must(end)),
      py::reinterpret_borrow<py::object>(clock)};
  PyObject* raw[kStepFields];
  for (Py_ssize_t i = 0; i < kStepFields; ++i) {
    if (!args[i]) {
      throw py::error_already_set();
    }
    raw[i] = args[i].ptr();
  }
  PyObject* record = PyObject_Vectorcall(cls.ptr(), raw, 0, n.kwnames);
  if (record == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(record);
}

// build_step(step, cls, rank, ddp, clock)
PyObject* raw_build_step(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("build_step(step, cls, rank, ddp, clock)", n, 5);
    return build_step(args[0], args[1], args[2], args[3], args[4]);
  });
}

}  // namespace
