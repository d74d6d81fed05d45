// CPython slot access: a step of ``OpenStep`` (ddpdoctor/runtime/step/recorder.py) read and written
// at its slots' offsets, read once from the class's slot descriptors, where an attribute read goes
// through the class's dictionary to a descriptor (the change of step and the record's build run with
// cold caches). Any other class is read and set by name. Also the layout of ``OpenStep.packed``.
//
// Python twin: recorder.OpenStep's ``__slots__`` and recorder.unpack_marks (the packed
// marks' reader). Parity tests: tests/test_native_hook.py::test_step_opener_builds_the_step_python_builds
// (every slot), tests/test_step_build.py::test_packed_marks_build_the_record_their_lists_build.
// Twin kept: the class is Python's; this only knows where its slots are (a TypeError where the
// class is not the one it knows: read by name then).

#pragma once

#include <torch/extension.h>
#include <structmember.h>
#include <cstdint>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

struct StepSlots {
  PyTypeObject* cls = nullptr;  // strong
  // (interned name, offset) of every slot: ``get_attr`` and ``set_attr`` find a slot by its name's
  // pointer (the callers' names are interned too)
  std::vector<std::pair<PyObject*, Py_ssize_t>> by_name;
  Py_ssize_t index, t0, t0_mono_ns, t0_wall_ns, micro, fwd_start, fwd_end, bcast, bcast_bytes, bwd_end, ready,
      launch, done, nbytes, opt_start, opt_end, end, synced_forward, layout, comm_hook, all_marks, arrived,
      done_seen, sync, packed;
  ~StepSlots() {
    Py_XDECREF(cls);
  }
};

Py_ssize_t slot_offset(PyTypeObject* cls, const char* name) {
  py::object d = py::reinterpret_steal<py::object>(PyObject_GetAttrString(reinterpret_cast<PyObject*>(cls), name));
  if (!d) {
    PyErr_Clear();  // (a refusal is a TypeError, whatever the class lacks: Python builds its steps then)
    throw py::type_error(std::string("step_opener: no slot ") + name);
  }
  if (!Py_IS_TYPE(d.ptr(), &PyMemberDescr_Type)) {
    throw py::type_error(std::string("step_opener: ") + name + " is not a slot");
  }
  PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(d.ptr())->d_member;
  if (member->type != T_OBJECT_EX || (member->flags & READONLY) != 0) {
    throw py::type_error(std::string("step_opener: ") + name + " is not a plain slot");
  }
  return member->offset;
}

// The slot offsets of ``cls`` (OpenStep): its slots must be exactly these, and it has no __dict__
// (a TypeError otherwise).
std::shared_ptr<StepSlots> step_slots(py::handle cls_handle) {
  static const char* const kNames[] = {"index", "t0", "t0_mono_ns", "t0_wall_ns", "micro", "fwd_start", "fwd_end",
                                       "bcast", "bcast_bytes", "bwd_end", "ready", "launch", "done", "nbytes",
                                       "opt_start", "opt_end", "end", "synced_forward", "layout", "comm_hook",
                                       "all_marks", "arrived", "done_seen", "sync", "packed"};
  if (!PyType_Check(cls_handle.ptr())) {
    throw py::type_error("step_opener: a class");
  }
  auto* cls = reinterpret_cast<PyTypeObject*>(cls_handle.ptr());
  py::tuple slots = py::reinterpret_borrow<py::object>(cls_handle).attr("__slots__");
  if (cls->tp_dictoffset != 0 || cls->tp_base != &PyBaseObject_Type ||
      static_cast<size_t>(PyTuple_GET_SIZE(slots.ptr())) != std::size(kNames)) {
    throw py::type_error("step_opener: not the OpenStep this extension knows");
  }
  auto s = std::make_shared<StepSlots>();
  Py_ssize_t* out[] = {&s->index,     &s->t0,        &s->t0_mono_ns, &s->t0_wall_ns, &s->micro,     &s->fwd_start,
                       &s->fwd_end,   &s->bcast,     &s->bcast_bytes, &s->bwd_end,   &s->ready,     &s->launch,
                       &s->done,      &s->nbytes,    &s->opt_start,  &s->opt_end,    &s->end,       &s->synced_forward,
                       &s->layout,    &s->comm_hook, &s->all_marks,  &s->arrived,    &s->done_seen, &s->sync,
                       &s->packed};
  for (size_t i = 0; i < std::size(kNames); ++i) {
    *out[i] = slot_offset(cls, kNames[i]);
    s->by_name.emplace_back(PyUnicode_InternFromString(kNames[i]), *out[i]);  // (interned: kept for good)
  }
  s->cls = reinterpret_cast<PyTypeObject*>(Py_NewRef(cls_handle.ptr()));
  return s;
}

// The slots of each class whose steps ``build_step`` was given, found once a class: a step of the
// OpenStep this extension knows is read at its slots' offsets, with no attribute lookup (through
// the class's dictionary to its descriptor: a record's 18 reads, with the caches as cold as they
// are in a batch of closed steps). Any other class (null here) is read by name.
const StepSlots* known_slots(PyTypeObject* type) {
  static std::vector<std::pair<PyTypeObject*, std::shared_ptr<StepSlots>>> seen;
  for (const auto& [t, slots] : seen) {
    if (t == type) {
      return slots.get();
    }
  }
  std::shared_ptr<StepSlots> slots;
  try {
    slots = step_slots(py::handle(reinterpret_cast<PyObject*>(type)));
  } catch (py::error_already_set&) {
    PyErr_Clear();  // not the OpenStep this extension knows: read by name
  } catch (const py::type_error&) {
  }
  Py_INCREF(type);  // (kept with its entry, for the life of the process: one a class)
  seen.emplace_back(type, slots);
  return slots.get();
}

// Where ``obj``'s slot ``name`` (interned) is, when ``obj`` is of the OpenStep this extension knows;
// null otherwise (read and set by name then).
PyObject** slot_of(PyObject* obj, PyObject* name) {
  const StepSlots* slots = known_slots(Py_TYPE(obj));
  if (slots == nullptr) {
    return nullptr;
  }
  for (const auto& [n, offset] : slots->by_name) {
    if (n == name) {
      return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
    }
  }
  return nullptr;
}

// ``obj.<name>``, read by name (a new reference; the error raised where the read fails).
py::object attr_of(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (value == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(value);
}

// ``step.<name>`` (a new reference; an unset slot raises AttributeError, as the read by name does).
// An OpenStep's slot is read at its offset: the change of step and the record's build run with
// cold caches, where a read by name goes through the class's dictionary to a descriptor.
py::object get_attr(py::handle step, PyObject* name) {
  if (PyObject** slot = slot_of(step.ptr(), name)) {
    if (*slot == nullptr) {
      PyErr_SetObject(PyExc_AttributeError, name);
      throw py::error_already_set();
    }
    return py::reinterpret_borrow<py::object>(*slot);
  }
  return attr_of(step.ptr(), name);
}

// ``step.<name> = value`` (``value`` NULL: the error set).
void set_attr(py::handle step, PyObject* name, PyObject* value) {
  if (value == nullptr) {
    throw py::error_already_set();
  }
  if (PyObject** slot = slot_of(step.ptr(), name)) {  // (an OpenStep's: at its offset, as get_attr)
    PyObject* old = *slot;
    *slot = Py_NewRef(value);
    Py_XDECREF(old);
    return;
  }
  if (PyObject_SetAttr(step.ptr(), name, value) != 0) {
    throw py::error_already_set();
  }
}

// Sets a slot that holds NULL (a fresh object) to a new reference; ``value`` NULL: the error set.
void put(PyObject* obj, Py_ssize_t offset, PyObject* value) {
  if (value == nullptr) {
    throw py::error_already_set();
  }
  *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset) = value;
}

// A packed mark that is not there: an all-reduce not seen complete (None in the lists).
constexpr int64_t kPackedNone = INT64_MIN;
// int64s per bucket in ``OpenStep.packed``: ready, launch, done.
constexpr Py_ssize_t kPackedFields = 3;

}  // namespace
