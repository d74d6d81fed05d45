// ddpdoctor's native extension, one translation unit: the pybind module and its plain functions.
//
// Built by ddpdoctor/runtime/step/native_hook.py with torch.utils.cpp_extension.load_inline from the text
// ddpdoctor/native_cache.py source_text() makes of this file: each ``#include "x.h"`` of this folder
// replaced by the file itself (once, each from a ``#line`` that names it, so the compiler's messages
// name the file and line here), and the extension's name hashes that whole text. One translation
// unit because torch's headers cost 20-40 s of compile each. The calls of every step (the drain,
// the optimizer's stamps and their take, the requires_grad check, the record's build, the change of
// step, the compact log's arithmetic) are plain CPython functions, not pybind11 ones (fastcall.h).
//
// One concern a file, each naming its Python twin and the test that holds the two together:
//   comm_hook.h          the comm hook and its ring (comm_hook.py timed_hook)
//   drain.h              the ring's marks into a step (StepRecorder.add_bucket_columns)
//   lanes.h              the vector multiply and non-finite check (torch's mul_, isfinite)
//   bucket_scale.h       a CPU bucket's scale through lanes.h
//   ddp_scale.h          DDP's own scaling, bit for bit (DdpScale)
//   accumulator_hooks.h  what the gradient accumulators' pre-hooks share
//   optimizer.h          the optimizer step's stamps (StepRecorder.optimizer_start/_end)
//   param_checks.h       per-parameter arrivals and requires_grad (SampledChecks)
//   fingerprints.h       tensor fingerprints (fingerprints.float_values, tensor_bits)
//   step_build.h         the step record (StepRecorder._emit_step)
//   step_change.h        a new step, the routine forward's change of step (OpenStep, forward_start)
//   column.h             a record's bucket column type
//   compact.h            the compact log's arithmetic (sinks.compact)
//   slots.h              CPython slot access to OpenStep
//   fastcall.h           calls without pybind11's dispatcher
//   clock.h              the clocks

// (first: Python.h must come before any standard header)
#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "accumulator_hooks.h"
#include "bucket_scale.h"
#include "clock.h"
#include "column.h"
#include "comm_hook.h"
#include "compact.h"
#include "ddp_scale.h"
#include "drain.h"
#include "fastcall.h"
#include "fingerprints.h"
#include "lanes.h"
#include "optimizer.h"
#include "param_checks.h"
#include "slots.h"
#include "step_build.h"
#include "step_change.h"

namespace {

PyMethodDef kModuleFunctions[] = {
    {"same_requires_grad", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_same_requires_grad)),
     METH_FASTCALL, "same_requires_grad(tensors, expected): each tensor's requires_grad is the byte given for it"},
    {"build_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_build_step)), METH_FASTCALL,
     "build_step(step, cls, rank, ddp, clock): the Step record of a closed OpenStep with host-clock marks "
     "(StepRecorder's, built in C++)"},
    {"judge_phases", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_judge_phases)), METH_FASTCALL,
     "judge_phases(step, judging, recent): sinks.compact's judge of a step's phases against their limits"},
    {"window_columns", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_window_columns)),
     METH_FASTCALL, "window_columns(rows): sinks.compact's columns of a window's rows (None: left to Python)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddpdoctor's per-bucket timing comm hook (ring of ready/launch/done stamps)";
  column_type = make_column_type();
  m.add_object("Column", py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(column_type)));
  py::class_<Handle>(m, "Timing")
      .def(
          "peek",
          [](Handle& h) {
            c10::SmallVector<Entry, 32> entries;
            h.ring->peek(entries);
            std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> out;
            out.reserve(entries.size());
            for (const Entry& e : entries) {
              out.emplace_back(e.index, e.ready, e.launch, e.done, e.bytes);
            }
            return out;
          })
      .def("want_layout", [](Handle& h, bool on) { h.ring->want_layout(on); })
      .def("take_layout", [](Handle& h) { return h.ring->take_layout(); })
      .def("set_enabled", [](Handle& h, bool on) { h.ring->set_enabled(on); })
      .def("dropped", [](Handle& h) { return h.ring->dropped(); })
      .def("stamp_ends", [](Handle& h, bool on) { h.ring->stamp_ends(on); })
      .def("drain_columns", &drain_columns, py::arg("offset"))
      // (a plain function bound to the ring: read it once, call it every step)
      .def_property_readonly("drain_into", [](Handle& h) { return bound(&kDrainInto, h.ring); })
      .def("backward_end", [](Handle& h) { return h.ring->backward_end(); })
      .def("capacity", [](Handle& h) { return h.ring->capacity(); })
      .def(
          "delegate",
          [](Handle& h, py::object state, py::object hook) {
            h.delegate->set(std::make_shared<c10d::PythonCommHook>(std::move(state), std::move(hook)));
          },
          py::arg("state"),
          py::arg("hook"));
  py::class_<OptimizerStamps, std::shared_ptr<OptimizerStamps>>(m, "OptimizerStamps")
      .def(py::init<>())
      // plain functions bound to the stamps: read each once (the hooks registered, the take kept)
      .def_property_readonly("pre", [](std::shared_ptr<OptimizerStamps> s) { return bound(&kStampStart, s); })
      .def_property_readonly("post", [](std::shared_ptr<OptimizerStamps> s) { return bound(&kStampEnd, s); })
      .def_property_readonly("take_into", [](std::shared_ptr<OptimizerStamps> s) { return bound(&kTakeInto, s); })
      .def("take", &OptimizerStamps::take, py::arg("offset"))
      .def("running", &OptimizerStamps::running);
  py::class_<ParamSample>(m, "ParamSample")
      .def(py::init<const std::vector<at::Tensor>&>(), py::arg("params"))
      .def("end", &ParamSample::end, py::arg("offset"));
  m.def("register_timed_hook", &register_timed_hook, py::arg("reducer"), py::arg("group"), py::arg("capacity"),
        py::arg("scale") = py::none());
  py::class_<DdpScale, std::shared_ptr<DdpScale>>(m, "DdpScale",
                                                   "Scales a bucket in place as DDP's reducer scales its gradients")
      .def(py::init<const std::shared_ptr<c10d::Reducer>&, int64_t, const std::vector<at::Tensor>&, bool>(),
           py::arg("reducer"), py::arg("world_size"), py::arg("params"), py::arg("watch"))
      .def("__call__", &DdpScale::apply, py::arg("bucket"))
      .def_property_readonly("watches", &DdpScale::watches)
      .def("watch_nonfinite", &DdpScale::watch_nonfinite, py::arg("flag"),
           "Set flag[0] = 1 when a bucket holds a NaN or an infinity (None: stop looking)")
      .def("take_nonfinite", &DdpScale::take_nonfinite,
           "[(bucket index, [(TensorImpl address, NaN count, inf count)])] noted since the last take")
      .def_property_readonly_static("reads_divisor", [](py::object) { return kReadsDivisor; });
  m.def("accepts", &accepts, py::arg("reducer"), py::arg("group"));
  m.def("tensor_values", &tensor_values, py::arg("tensors"), py::arg("sums_from"),
        "(norms, sums from sums_from on, bits) of CPU tensors, as fingerprints.float_values and tensor_bits");
  for (PyMethodDef* def = kModuleFunctions; def->ml_name != nullptr; ++def) {
    m.add_object(def->ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(def, nullptr, m.ptr())));
  }
  m.def("step_opener", &step_opener, py::arg("cls"), "open(index, t0, offset, synced): new OpenSteps of cls, built in C++");
  m.def("step_changer", &step_changer, py::arg("timing"), py::arg("stamps"), py::arg("cls"),
        "change(step, index, offset, same_bytes): the routine forward's change of step in one call");
  m.def("clock_ns", &clock_ns, "now on the hook's clock (ns); compared with time.perf_counter_ns()");
}
