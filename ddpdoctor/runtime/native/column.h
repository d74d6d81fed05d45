// Column: a step record's bucket column, packed.
//
// The records built in C++ hold their per-bucket offsets (b_ready_us, b_launch_us, b_done_us) as a
// Column: one object of doubles (NaN for None), read-only, where a list held a float object per
// bucket. A record is built in a batch of closed steps and freed a hundred steps later by the live
// window, both with cold caches, and its float objects were most of that: allocated, counted, freed
// one by one (BENCHMARKS.md). A Column reads as a list does (len, index, slice, iteration, ``in``,
// ``==`` with a list, repr); ``tolist()`` gives the list, which is what the log's encoder writes
// (``events.codec``) and what a copy or a pickle of it becomes. Not tracked by the cyclic GC: it
// holds no object.
//
// Python twin: the plain list a record built in Python holds (StepRecorder._emit_step).
// Parity test: tests/test_step_build.py::test_a_column_reads_as_its_list_and_encodes_as_it.
// Twin kept: a list is what Python builds anyway; nothing of this type's is copied there.

#pragma once

#include <torch/extension.h>
#include <cmath>
#include <cstddef>

namespace {

struct ColumnObject {
  PyObject_VAR_HEAD
  double values[1];
};

PyTypeObject* column_type = nullptr;  // (made at import: PyType_FromSpec)

inline ColumnObject* as_column(PyObject* self) {
  return reinterpret_cast<ColumnObject*>(self);
}

// A new Column of ``n`` values (left for the caller to fill). An empty column is an empty list
// instead: msgspec leaves a field out when it is the default's empty list.
ColumnObject* new_column(Py_ssize_t n) {
  ColumnObject* c = PyObject_NewVar(ColumnObject, column_type, n);
  if (c == nullptr) {
    throw py::error_already_set();
  }
  return c;
}

PyObject* column_value(double v) {
  if (std::isnan(v)) {
    Py_RETURN_NONE;
  }
  return PyFloat_FromDouble(v);
}

PyObject* column_tolist(PyObject* self, PyObject* /*unused*/ = nullptr) {
  const Py_ssize_t n = Py_SIZE(self);
  PyObject* list = PyList_New(n);
  if (list == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = column_value(as_column(self)->values[i]);
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, i, item);
  }
  return list;
}

void column_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_Free(self);
  Py_DECREF(type);  // (a heap type: each instance holds a reference to it)
}

Py_ssize_t column_length(PyObject* self) {
  return Py_SIZE(self);
}

PyObject* column_item(PyObject* self, Py_ssize_t i) {
  if (i < 0 || i >= Py_SIZE(self)) {
    PyErr_SetString(PyExc_IndexError, "column index out of range");
    return nullptr;
  }
  return column_value(as_column(self)->values[i]);
}

PyObject* column_subscript(PyObject* self, PyObject* key) {
  if (PyIndex_Check(key)) {
    Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) {
      return nullptr;
    }
    if (i < 0) {
      i += Py_SIZE(self);
    }
    return column_item(self, i);
  }
  if (PySlice_Check(key)) {  // a list, as a list's slice is
    PyObject* list = column_tolist(self);
    if (list == nullptr) {
      return nullptr;
    }
    PyObject* out = PyObject_GetItem(list, key);
    Py_DECREF(list);
    return out;
  }
  PyErr_Format(PyExc_TypeError, "column indices must be integers or slices, not %.200s", Py_TYPE(key)->tp_name);
  return nullptr;
}

int column_contains(PyObject* self, PyObject* value) {
  const Py_ssize_t n = Py_SIZE(self);
  const double* v = as_column(self)->values;
  if (value == Py_None) {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (std::isnan(v[i])) {
        return 1;
      }
    }
    return 0;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {  // (as a list's: each item compared with ==)
    PyObject* item = column_value(v[i]);
    if (item == nullptr) {
      return -1;
    }
    const int eq = PyObject_RichCompareBool(item, value, Py_EQ);
    Py_DECREF(item);
    if (eq != 0) {
      return eq;
    }
  }
  return 0;
}

// Compared as its list would be (a Column equals the list of its values).
PyObject* column_richcompare(PyObject* self, PyObject* other, int op) {
  if (!PyList_Check(other) && !(column_type != nullptr && Py_IS_TYPE(other, column_type))) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  PyObject* mine = column_tolist(self);
  if (mine == nullptr) {
    return nullptr;
  }
  PyObject* theirs = PyList_Check(other) ? Py_NewRef(other) : column_tolist(other);
  if (theirs == nullptr) {
    Py_DECREF(mine);
    return nullptr;
  }
  PyObject* out = PyObject_RichCompare(mine, theirs, op);
  Py_DECREF(mine);
  Py_DECREF(theirs);
  return out;
}

PyObject* column_repr(PyObject* self) {
  PyObject* list = column_tolist(self);
  if (list == nullptr) {
    return nullptr;
  }
  PyObject* out = PyObject_Repr(list);
  Py_DECREF(list);
  return out;
}

// ``column + list`` and ``list + column`` as the lists would add (a list's own ``+`` takes lists
// only, and tries the other operand's addition first).
PyObject* column_add(PyObject* a, PyObject* b) {
  const bool a_column = Py_IS_TYPE(a, column_type), b_column = Py_IS_TYPE(b, column_type);
  if (!(a_column || PyList_Check(a)) || !(b_column || PyList_Check(b))) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  PyObject* left = a_column ? column_tolist(a) : Py_NewRef(a);
  if (left == nullptr) {
    return nullptr;
  }
  PyObject* right = b_column ? column_tolist(b) : Py_NewRef(b);
  if (right == nullptr) {
    Py_DECREF(left);
    return nullptr;
  }
  PyObject* out = PySequence_Concat(left, right);
  Py_DECREF(left);
  Py_DECREF(right);
  return out;
}

// A copy is itself (read-only); a pickle is its list (the extension's module is not importable by
// name in another process).
PyObject* column_self(PyObject* self, PyObject* /*unused*/) {
  return Py_NewRef(self);
}

PyObject* column_reduce(PyObject* self, PyObject* /*unused*/) {
  PyObject* list = column_tolist(self);
  if (list == nullptr) {
    return nullptr;
  }
  return Py_BuildValue("(O(N))", reinterpret_cast<PyObject*>(&PyList_Type), list);
}

PyMethodDef column_methods[] = {
    {"tolist", column_tolist, METH_NOARGS, "The values as a list (None where a bucket was not seen)."},
    {"__copy__", column_self, METH_NOARGS, nullptr},
    {"__deepcopy__", column_self, METH_O, nullptr},
    {"__reduce__", column_reduce, METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject* make_column_type() {
  static PyType_Slot slots[] = {
      {Py_tp_dealloc, reinterpret_cast<void*>(column_dealloc)},
      {Py_tp_repr, reinterpret_cast<void*>(column_repr)},
      {Py_tp_richcompare, reinterpret_cast<void*>(column_richcompare)},
      {Py_tp_hash, reinterpret_cast<void*>(PyObject_HashNotImplemented)},
      {Py_tp_methods, column_methods},
      {Py_tp_doc,
       const_cast<char*>("A step record's bucket column: µs from the step's start, None where not seen (read-only).")},
      {Py_nb_add, reinterpret_cast<void*>(column_add)},
      {Py_sq_length, reinterpret_cast<void*>(column_length)},
      {Py_sq_item, reinterpret_cast<void*>(column_item)},
      {Py_sq_contains, reinterpret_cast<void*>(column_contains)},
      {Py_mp_length, reinterpret_cast<void*>(column_length)},
      {Py_mp_subscript, reinterpret_cast<void*>(column_subscript)},
      {0, nullptr}};
  static PyType_Spec spec = {"ddpdoctor.Column", static_cast<int>(offsetof(ColumnObject, values)),
                             static_cast<int>(sizeof(double)), Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
                             slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (type == nullptr) {
    throw py::error_already_set();
  }
  return reinterpret_cast<PyTypeObject*>(type);
}

}  // namespace
