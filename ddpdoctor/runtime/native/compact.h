// The compact log's per-step arithmetic (sinks.compact, on the log writer's thread).
//
// The writer judges every step's phases against their running medians, and writes the steps
// between anomalies as a window's rows, in columns of whole µs. In Python that was most of the
// writer's CPU: 19-22 µs a step in a 2-rank run of the short model, three times its warm cost, on
// a thread that shares the ranks' cores and their training threads' GIL (BENCHMARKS.md). These
// two functions do the same arithmetic on the same objects and give the same values;
// ``sinks.compact`` keeps its Python for everything else.
//
// Python twin: ddpdoctor/sinks/compact.py window_columns and _Medians.judge (with _phases).
// Parity tests: tests/test_compact_log.py::test_window_columns_in_cpp_are_python_s_or_left_to_it,
// ::test_judge_phases_in_cpp_is_python_s, ::test_the_extension_compacts_to_the_bytes_python_writes.
// Twin kept: the writer runs where the extension is not loaded (a GPU job, no compiler), and
// ``window_columns`` leaves to Python every value of a type it does not handle (None).

#pragma once

#include <torch/extension.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "column.h"
#include "slots.h"
#include "fastcall.h"

namespace {

struct CompactNames {
  std::array<PyObject*, 8> marks;  // compact._MARKS: what a step's phases are worked out from
  std::array<PyObject*, 14> row;   // compact._ROW: a window row's values
};

const CompactNames& compact_names() {
  static const CompactNames names = [] {
    CompactNames n{};
    const char* marks[] = {"end_us",     "fwd_start_us", "fwd_us",       "fwd_end_us",
                           "bwd_end_us", "sync_end_us",  "opt_start_us", "opt_end_us"};
    const char* row[] = {"t0_mono_ns", "t0_wall_ns", "micro",       "fwd_start_us", "fwd_us",
                         "bcast_start_us", "bcast_us", "fwd_end_us", "bwd_end_us", "sync_end_us",
                         "opt_start_us", "opt_end_us", "end_us",     "b_ready_us"};
    for (size_t i = 0; i < n.marks.size(); ++i) {
      n.marks[i] = PyUnicode_InternFromString(marks[i]);
    }
    for (size_t i = 0; i < n.row.size(); ++i) {
      n.row[i] = PyUnicode_InternFromString(row[i]);
    }
    return n;
  }();
  return names;
}

// ``a - b`` as Python computes it, or None where either is None (a new reference).
PyObject* difference(PyObject* a, PyObject* b) {
  if (a == Py_None || b == Py_None) {
    Py_RETURN_NONE;
  }
  if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b)) {
    return PyFloat_FromDouble(PyFloat_AS_DOUBLE(a) - PyFloat_AS_DOUBLE(b));
  }
  return PyNumber_Subtract(a, b);
}

// judge_phases(step, judging, recent): compact._Medians.judge's arithmetic. The step's phases (the
// step, the data wait, the forward, the backward after it, the wait after the backward, the
// optimizer step: compact._phases) against ``judging``'s (phase, limit) pairs: True where one is
// above its limit. Then the phases' tuple is appended to ``recent``, as Python does after judging.
py::object judge_phases(PyObject* step, PyObject* judging, PyObject* recent) {
  const CompactNames& names = compact_names();
  std::array<py::object, 8> m;
  for (size_t i = 0; i < m.size(); ++i) {
    m[i] = attr_of(step, names.marks[i]);
  }
  // end, fwd_start, fwd, bwd_end - fwd_end, sync_end - bwd_end, opt_end - opt_start
  py::tuple phases(6);
  PyObject* t = phases.ptr();
  PyTuple_SET_ITEM(t, 0, m[0].inc_ref().ptr());
  PyTuple_SET_ITEM(t, 1, m[1].inc_ref().ptr());
  PyTuple_SET_ITEM(t, 2, m[2].inc_ref().ptr());
  const std::array<std::pair<size_t, size_t>, 3> spans = {{{4, 3}, {5, 4}, {7, 6}}};
  for (size_t k = 0; k < spans.size(); ++k) {
    PyObject* d = difference(m[spans[k].first].ptr(), m[spans[k].second].ptr());
    if (d == nullptr) {
      throw py::error_already_set();
    }
    PyTuple_SET_ITEM(t, 3 + static_cast<Py_ssize_t>(k), d);
  }
  if (!PyList_Check(judging) || !PyList_Check(recent)) {
    throw py::type_error("judge_phases(step, judging, recent): judging and recent are lists");
  }
  bool slow = false;
  const py::list pairs = py::reinterpret_borrow<py::list>(judging);  // (held: a compare may run Python)
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(judging) && !slow; ++k) {
    const py::object pair = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(judging, k));
    if (!PyTuple_Check(pair.ptr()) || PyTuple_GET_SIZE(pair.ptr()) != 2) {
      throw py::type_error("judge_phases: judging holds (phase, limit) pairs");
    }
    const Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair.ptr(), 0));
    if (i == -1 && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    if (i < 0 || i >= 6) {
      throw py::index_error("judge_phases: a phase index out of range");
    }
    PyObject* v = PyTuple_GET_ITEM(t, i);
    PyObject* limit = PyTuple_GET_ITEM(pair.ptr(), 1);
    if (v == Py_None) {
      continue;
    }
    if (PyFloat_CheckExact(v) && PyFloat_CheckExact(limit)) {
      slow = PyFloat_AS_DOUBLE(v) > PyFloat_AS_DOUBLE(limit);
    } else {
      const int above = PyObject_RichCompareBool(v, limit, Py_GT);
      if (above < 0) {
        throw py::error_already_set();
      }
      slow = above == 1;
    }
  }
  if (PyList_Append(recent, t) < 0) {
    throw py::error_already_set();
  }
  return py::bool_(slow);
}

// round(x) of a float, as Python rounds it: to the nearest integer, ties to even (an int object;
// NaN and infinities raise as round() does).
PyObject* rounded(double x) {
  double r = std::round(x);
  if (std::fabs(x - r) == 0.5) {
    r = 2.0 * std::round(x / 2.0);
  }
  return PyLong_FromDouble(r);
}

int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

struct Unhandled {};  // a value of a type the C++ leaves to Python (window_columns returns None)

int64_t exact_int(PyObject* value) {
  if (!PyLong_CheckExact(value)) {
    throw Unhandled{};
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    throw Unhandled{};
  }
  return v;
}

PyObject* new_int(int64_t v) {
  PyObject* out = PyLong_FromLongLong(v);
  if (out == nullptr) {
    throw py::error_already_set();
  }
  return out;
}

// A phase column (compact._rounded): whole µs, None kept; empty where every value is None.
py::list rounded_column(const std::vector<PyObject*>& values) {
  size_t none = 0;
  for (PyObject* v : values) {
    if (v == Py_None) {
      ++none;
    } else if (!PyFloat_CheckExact(v) && !PyLong_CheckExact(v)) {
      throw Unhandled{};
    }
  }
  if (none == values.size()) {
    return py::list();
  }
  py::list out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v = values[i];
    PyObject* item;
    if (v == Py_None || PyLong_CheckExact(v)) {  // (round of an int is the int)
      item = Py_NewRef(v);
    } else {
      item = rounded(PyFloat_AS_DOUBLE(v));
      if (item == nullptr) {
        throw py::error_already_set();
      }
    }
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

// The earliest and the latest bucket ready of a row's b_ready_us (a Column, or a list or tuple of
// floats and None), None skipped; false where it has no value.
bool ready_span(PyObject* ready, double* first, double* last) {
  bool any = false;
  auto take = [&](double v) {
    if (!any) {
      *first = *last = v;
      any = true;
    } else {
      *first = std::min(*first, v);
      *last = std::max(*last, v);
    }
  };
  if (Py_TYPE(ready) == column_type) {
    const ColumnObject* c = as_column(ready);
    for (Py_ssize_t i = 0; i < Py_SIZE(ready); ++i) {
      if (!std::isnan(c->values[i])) {  // (NaN: a bucket not seen, None)
        take(c->values[i]);
      }
    }
    return any;
  }
  if (!PyList_CheckExact(ready) && !PyTuple_CheckExact(ready)) {
    throw Unhandled{};
  }
  PyObject** items = PySequence_Fast_ITEMS(ready);
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ready); ++i) {
    PyObject* v = items[i];
    if (v == Py_None) {
      continue;
    }
    if (!PyFloat_CheckExact(v) || std::isnan(PyFloat_AS_DOUBLE(v))) {  // (min and max of NaN: Python's)
      throw Unhandled{};
    }
    take(PyFloat_AS_DOUBLE(v));
  }
  return any;
}

// window_columns(rows): compact.window_columns of a window's rows (Step records), the same
// lists: (t0, wall, micro, fwd_start, fwd, bcast_start, bcast, fwd_end, bwd_end, ready_first,
// ready_last, sync_end, opt_start, opt_end, end); None where a value is of a type left to Python.
py::object window_columns(PyObject* rows) {
  if (!PyList_Check(rows) || PyList_GET_SIZE(rows) == 0) {
    throw py::type_error("window_columns(rows): a non-empty list of steps");
  }
  const CompactNames& names = compact_names();
  // (a tuple of the rows: a read below may run Python code, which could change the list)
  const py::tuple held = py::reinterpret_steal<py::tuple>(PyList_AsTuple(rows));
  if (!held) {
    throw py::error_already_set();
  }
  const size_t n = static_cast<size_t>(PyTuple_GET_SIZE(held.ptr()));
  std::vector<py::object> values;  // (row-major: the 14 values of each row, held)
  values.reserve(n * names.row.size());
  for (size_t r = 0; r < n; ++r) {
    PyObject* row = PyTuple_GET_ITEM(held.ptr(), static_cast<Py_ssize_t>(r));
    for (PyObject* name : names.row) {
      values.push_back(attr_of(row, name));
    }
  }
  const size_t width = names.row.size();
  auto at = [&](size_t r, size_t c) { return values[r * width + c].ptr(); };
  try {
    const int64_t base_mono = exact_int(at(0, 0));
    const int64_t skew = exact_int(at(0, 1)) - base_mono;
    py::list t0(n);
    py::list wall(n);
    bool any_wall = false;
    bool any_micro = false;
    int64_t previous = 0;
    for (size_t r = 0; r < n; ++r) {
      const int64_t mono = exact_int(at(r, 0));
      const int64_t since = floor_div(mono - base_mono + 500, 1000);  // (rounded once, absolute)
      PyList_SET_ITEM(t0.ptr(), static_cast<Py_ssize_t>(r), new_int(since - previous));
      previous = since;
      const int64_t w = floor_div(exact_int(at(r, 1)) - mono - skew + 500, 1000);
      any_wall = any_wall || w != 0;
      PyList_SET_ITEM(wall.ptr(), static_cast<Py_ssize_t>(r), new_int(w));
      const int truthy = PyObject_IsTrue(at(r, 2));
      if (truthy < 0) {
        throw py::error_already_set();
      }
      any_micro = any_micro || truthy == 1;
    }
    py::list micro;
    if (any_micro) {
      micro = py::list(n);
      for (size_t r = 0; r < n; ++r) {
        PyList_SET_ITEM(micro.ptr(), static_cast<Py_ssize_t>(r), Py_NewRef(at(r, 2)));
      }
    }
    std::vector<PyObject*> column(n);
    auto phase = [&](size_t c) {
      for (size_t r = 0; r < n; ++r) {
        column[r] = at(r, c);
      }
      return rounded_column(column);
    };
    py::list first(n);
    py::list last(n);
    bool any_ready = false;
    for (size_t r = 0; r < n; ++r) {
      double lo = 0.0;
      double hi = 0.0;
      PyObject* f = Py_None;
      PyObject* l = Py_None;
      if (ready_span(at(r, 13), &lo, &hi)) {
        any_ready = true;
        f = rounded(lo);
        l = f == nullptr ? nullptr : rounded(hi);
        if (l == nullptr) {
          Py_XDECREF(f);
          throw py::error_already_set();
        }
      } else {
        Py_INCREF(f);
        Py_INCREF(l);
      }
      PyList_SET_ITEM(first.ptr(), static_cast<Py_ssize_t>(r), f);
      PyList_SET_ITEM(last.ptr(), static_cast<Py_ssize_t>(r), l);
    }
    return py::make_tuple(t0, any_wall ? wall : py::list(), micro, phase(3), phase(4), phase(5), phase(6),
                          phase(7), phase(8), any_ready ? first : py::list(), any_ready ? last : py::list(),
                          phase(9), phase(10), phase(11), phase(12));
  } catch (const Unhandled&) {
    return py::none();
  }
}

// judge_phases(step, judging, recent)
PyObject* raw_judge_phases(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("judge_phases(step, judging, recent)", n, 3);
    return judge_phases(args[0], args[1], args[2]);
  });
}

// window_columns(rows)
PyObject* raw_window_columns(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("window_columns(rows)", n, 1);
    return window_columns(args[0]);
  });
}

}  // namespace
