// Calls without pybind11's dispatcher.
//
// The calls made at every step are plain CPython functions (METH_FASTCALL): the drain, the
// optimizer's two stamps and their take, the requires_grad check and the record's build. They run
// after the backward and the optimizer step, when the instruction and data caches are cold, and
// pybind11's dispatcher (overload records, argument loaders, the keep-alive stack) is a lot of code
// to fetch: on this project's 2-core VM, with the caches flushed before each call, a pybind11 call
// of two arguments took 5.2-6.1 us and the same as a plain function 2.7-3.6 us (warm: 0.29 against
// 0.16-0.19 us). A method's state is a capsule of a shared_ptr, the function's ``self``: nothing of
// pybind11 is on the call's path. Each takes its arguments by position only. Each concern's file
// holds its own ``raw_`` wrappers and method records; bindings.cpp puts them in the module.
//
// No Python twin: the plumbing of the calls, no rule of ddpdoctor's.

#pragma once

#include <torch/extension.h>
#include <exception>
#include <memory>
#include <string>
#include <utility>

namespace {

template <typename T>
void release_held(PyObject* capsule) {
  delete static_cast<std::shared_ptr<T>*>(PyCapsule_GetPointer(capsule, nullptr));
}

template <typename T>
T& held(PyObject* capsule) {
  return **static_cast<std::shared_ptr<T>*>(PyCapsule_GetPointer(capsule, nullptr));
}

// ``def`` as a Python callable whose ``self`` is a capsule that shares ``state``.
template <typename T>
py::object bound(PyMethodDef* def, std::shared_ptr<T> state) {
  auto* box = new std::shared_ptr<T>(std::move(state));
  PyObject* capsule = PyCapsule_New(box, nullptr, &release_held<T>);
  if (capsule == nullptr) {
    delete box;
    throw py::error_already_set();
  }
  PyObject* fn = PyCFunction_NewEx(def, capsule, nullptr);
  Py_DECREF(capsule);  // the function holds it
  if (fn == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(fn);
}

// The body's result as a new reference, or NULL with the Python error set for what it threw (as
// pybind11 translates: its own exception types, then any std::exception as a RuntimeError).
template <typename F>
PyObject* guarded(F&& body) noexcept {
  try {
    return body().release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "ddpdoctor's extension: unknown C++ exception");
  }
  return nullptr;
}

void expect_args(const char* signature, Py_ssize_t given, Py_ssize_t wanted) {
  if (given != wanted) {
    throw py::type_error(std::string(signature) + ": " + std::to_string(wanted) + " positional arguments, " +
                         std::to_string(given) + " given");
  }
}

int64_t int_arg(PyObject* value) {
  const long long v = PyLong_AsLongLong(value);
  if (v == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return v;
}

}  // namespace
