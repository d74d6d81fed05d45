// The ring's marks into a step: ``drain_columns`` (every case, as columns), ``drain_into`` (the
// common case set on the OpenStep itself) and ``drain_packed`` (the routine forward's, packed).
//
// Python twin: ddpdoctor/runtime/step/recorder.py StepRecorder.add_bucket_columns (the whole-list
// rule: every bucket once, in index order, at least as many as the step holds) and
// StepRecorder.backward_end. Parity test: tests/test_native_drain.py.
// Twin kept: Python places the columns this hands back (out of order, a step holding more marks)
// and every drain of ``drain_columns`` (layout capture, probes off: NativeTiming.drain).

#pragma once

#include <torch/extension.h>
#include <c10/util/SmallVector.h>
#include <cstdint>

#include "comm_hook.h"
#include "slots.h"
#include "fastcall.h"

namespace {

// Whether the entries are buckets 0, 1, 2... each once: the common case, which ``drain_into``
// hands to the step whole (StepRecorder.add_bucket_columns has the same rule for the columns).
template <typename Entries>
bool in_index_order(const Entries& entries) {
  int64_t position = 0;
  for (const Entry& e : entries) {
    if (e.index != position++) {
      return false;
    }
  }
  return true;
}

// The ring's entries as the columns ``drain_columns`` returns (the out-of-order case of
// ``drain_into``, which took them already).
template <typename Entries>
py::tuple columns_of(const Entries& entries, bool in_order, int64_t backward_end, int64_t offset) {
  py::list indices, ready, launch, done, nbytes;
  for (const Entry& e : entries) {
    indices.append(e.index);
    ready.append(e.ready + offset);
    launch.append(e.launch + offset);
    if (e.done != 0) {
      done.append(e.done + offset);
    } else {
      done.append(py::none());
    }
    nbytes.append(e.bytes);
  }
  py::object end = backward_end != 0 ? py::object(py::int_(backward_end + offset)) : py::object(py::none());
  return py::make_tuple(indices, ready, launch, done, nbytes, in_order, end);
}

// The ring's entries as columns, on the host clock shifted by ``offset`` (the tests' clock
// offset): (indices, ready, launch, done, bytes, in index order, backward end), done None for an
// all-reduce not seen complete, backward end None when not stamped. Python lists built here: one
// call, no tuple per bucket.
py::tuple drain_columns(Handle& h, int64_t offset) {
  c10::SmallVector<Entry, 32> entries;
  const int64_t backward_end = h.ring->take(entries);
  return columns_of(entries, in_index_order(entries), backward_end, offset);
}

// A new list of Python ints, one per entry (``field`` of it, plus ``offset``; 0 gives None where
// ``zero_is_none``).
template <typename Entries>
py::object int_column(const Entries& entries, int64_t Entry::*field, int64_t offset, bool zero_is_none) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(entries.size()));
  if (list == nullptr) {
    throw py::error_already_set();
  }
  py::object owned = py::reinterpret_steal<py::object>(list);
  Py_ssize_t i = 0;
  for (const Entry& e : entries) {
    const int64_t v = e.*field;
    PyObject* item = nullptr;
    if (zero_is_none && v == 0) {
      item = Py_NewRef(Py_None);
    } else {
      item = PyLong_FromLongLong(v + offset);
      if (item == nullptr) {
        throw py::error_already_set();
      }
    }
    PyList_SET_ITEM(list, i++, item);
  }
  return owned;
}

// The ring's entries of the last backward, taken for ``step``, with what drain_into and
// drain_packed decide by: whether they are in index order, and the step's ready list as it is.
struct Taken {
  c10::SmallVector<Entry, 32> entries;
  int64_t backward_end = 0;  // 0: not stamped
  bool in_order = false;
  py::object ready;  // step.ready
};

Taken take_for(Ring& ring, py::handle step) {
  static PyObject* const ready_name = PyUnicode_InternFromString("ready");
  Taken t;
  t.backward_end = ring.take(t.entries);
  t.in_order = in_index_order(t.entries);
  t.ready = get_attr(step, ready_name);
  return t;
}

// The step's bwd_end, when None, set to the backward end stamped (plus ``offset``; 0: none).
void set_backward_end(py::handle step, int64_t backward_end, int64_t offset) {
  static PyObject* const bwd_end_name = PyUnicode_InternFromString("bwd_end");
  if (backward_end == 0) {
    return;
  }
  py::object current = get_attr(step, bwd_end_name);
  if (current.is_none()) {
    set_attr(step, bwd_end_name, py::int_(backward_end + offset).ptr());
  }
}

// ``drain_columns`` handed straight to ``step`` (an OpenStep) in the common case: every bucket
// once, in index order, at least as many as the step holds already. Its ready, launch, done and
// nbytes lists are then set whole (left as they are when the ring held no bucket), its bwd_end,
// when None, to the backward end, and None is returned. Otherwise nothing is set and the columns
// are returned, for Python (StepRecorder.add_bucket_columns). One call a step, no tuple unpacked.
// It runs first thing after a backward, when caches are cold: one lock, no vector of tuples, no
// columns tuple in the common case, attributes set through interned names.
py::object drain_into(Ring& ring, py::handle step, int64_t offset) {
  static PyObject* const ready_name = PyUnicode_InternFromString("ready");
  static PyObject* const launch_name = PyUnicode_InternFromString("launch");
  static PyObject* const done_name = PyUnicode_InternFromString("done");
  static PyObject* const nbytes_name = PyUnicode_InternFromString("nbytes");
  const Taken t = take_for(ring, step);
  const Py_ssize_t n_held = PyObject_Length(t.ready.ptr());
  if (n_held < 0) {
    throw py::error_already_set();
  }
  if (!t.in_order || static_cast<Py_ssize_t>(t.entries.size()) < n_held) {
    return columns_of(t.entries, t.in_order, t.backward_end, offset);
  }
  if (!t.entries.empty()) {
    set_attr(step, ready_name, int_column(t.entries, &Entry::ready, offset, false).ptr());
    set_attr(step, launch_name, int_column(t.entries, &Entry::launch, offset, false).ptr());
    set_attr(step, done_name, int_column(t.entries, &Entry::done, offset, true).ptr());
    set_attr(step, nbytes_name, int_column(t.entries, &Entry::bytes, 0, false).ptr());
  }
  set_backward_end(step, t.backward_end, offset);
  return py::none();
}

// ``drain_into`` for the routine forward's change of step (``step_changer``), which closes the
// step at once and whose record ``build_step`` builds in a later batch: the marks become one
// bytes object of int64s (``OpenStep.packed``: ready, launch, done per bucket, on the host clock
// plus ``offset``, done kPackedNone where not seen complete), not a Python int each in three new
// lists. Those ints were most of the drain's cost: allocated with cold caches, right after the
// backward, to be read once in the batch. The buckets' bytes go to ``nbytes`` as a list:
// ``same_bytes`` itself where it holds the same numbers (the recorder's last layout's list: most
// steps make no list, no int). Where the step holds bucket marks already, or the buckets came out
// of order, nothing is set and the columns are returned (drain_into's other case); no bucket:
// only the backward end is set.
py::object drain_packed(Ring& ring, py::handle step, int64_t offset, py::handle same_bytes) {
  static PyObject* const packed_name = PyUnicode_InternFromString("packed");
  static PyObject* const nbytes_name = PyUnicode_InternFromString("nbytes");
  const Taken t = take_for(ring, step);
  const int holds = PyObject_IsTrue(t.ready.ptr());
  if (holds < 0) {
    throw py::error_already_set();
  }
  if (!t.in_order || holds) {
    return columns_of(t.entries, t.in_order, t.backward_end, offset);
  }
  if (!t.entries.empty()) {
    const Py_ssize_t n = static_cast<Py_ssize_t>(t.entries.size());
    py::object packed = py::reinterpret_steal<py::object>(
        PyBytes_FromStringAndSize(nullptr, n * kPackedFields * static_cast<Py_ssize_t>(sizeof(int64_t))));
    if (!packed) {
      throw py::error_already_set();
    }
    auto* out = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(packed.ptr()));
    bool same = PyList_Check(same_bytes.ptr()) && PyList_GET_SIZE(same_bytes.ptr()) == n;
    for (Py_ssize_t i = 0; i < n; ++i) {
      const Entry& e = t.entries[i];
      out[i * kPackedFields] = e.ready + offset;
      out[i * kPackedFields + 1] = e.launch + offset;
      out[i * kPackedFields + 2] = e.done != 0 ? e.done + offset : kPackedNone;
      if (same) {
        PyObject* b = PyList_GET_ITEM(same_bytes.ptr(), i);
        int overflow = 0;
        same = PyLong_CheckExact(b) && PyLong_AsLongLongAndOverflow(b, &overflow) == e.bytes && overflow == 0;
      }
    }
    set_attr(step, packed_name, packed.ptr());
    if (same) {
      set_attr(step, nbytes_name, same_bytes.ptr());
    } else {
      set_attr(step, nbytes_name, int_column(t.entries, &Entry::bytes, 0, false).ptr());
    }
  }
  set_backward_end(step, t.backward_end, offset);
  return py::none();
}

// Timing.drain_into(step, offset)
PyObject* raw_drain_into(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("drain_into(step, offset)", n, 2);
    return drain_into(held<Ring>(self), args[0], int_arg(args[1]));
  });
}

PyMethodDef kDrainInto = {"drain_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_drain_into)),
                          METH_FASTCALL,
                          "drain_into(step, offset): the ring's stamps of the last backward into the OpenStep "
                          "(None), or their columns where Python must place them"};

}  // namespace
