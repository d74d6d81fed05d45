// ddpdoctor's per-bucket timing at C++ cost: a DDP comm hook that does what DDP does without a
// hook (scale the bucket as DDP would, see DdpScale; sum it across ranks) and stamps three instants per
// bucket on the monotonic clock: ready (the reducer hands the bucket over), launch (the
// all-reduce is enqueued) and done (the all-reduce completed, stamped on the comm library's
// thread). Each bucket's stamps go into a fixed-size ring that Python drains once per step.
//
// Why C++: a Python comm hook costs a C++->Python call per bucket and a Python callback on the
// comm thread (GIL hand-offs); on short steps that is ~15% of the step. Nothing here takes the
// GIL on the comm thread, and nothing allocates per bucket once the ring exists.
//
// The backward's compute end is stamped here too: the first bucket of a backward queues an
// autograd final callback, which runs once the graph is done, before DDP's own finalization
// (which waits for the all-reduces). Nothing is hooked on the forward's output, and the backward
// takes no GIL: Python drains the ring at its next hook of the step (the next forward's, close),
// which runs anyway.
//
// Built by ddpdoctor/runtime/native_hook.py with torch.utils.cpp_extension; the pybind functions
// at the bottom are its whole interface. The calls of every step (the drain, the optimizer's
// stamps and their take, the requires_grad check, the record's build) are plain CPython
// functions there, not pybind11 ones: see "Calls without pybind11's dispatcher".

#include <torch/extension.h>
#include <structmember.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <chrono>
#include <string>
#include <type_traits>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

// steady_clock is CLOCK_MONOTONIC on Linux: the clock of Python's time.perf_counter_ns().
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// torch 2.13+ stashes the Python contextvars Context in the thread-local state for the length of
// a backward, and gloo's work copies the thread-local state. A gloo thread that drops the last
// reference to that Context needs the GIL (at interpreter exit: the process aborts). The
// all-reduce is therefore enqueued with the Context taken out of the thread-local state, then
// put back. Torch versions without ThreadLocalPythonObjects::erase stash nothing: a no-op there.
template <typename T, typename = void>
struct HasErase : std::false_type {};
template <typename T>
struct HasErase<T, std::void_t<decltype(T::erase(std::declval<const std::string&>()))>> : std::true_type {};

template <typename T>
class WithoutBackwardContext {
 public:
  WithoutBackwardContext() {
    if constexpr (HasErase<T>::value) {
      if (T::contains(key())) {
        saved_ = T::get(key());
        T::erase(key());
      }
    }
  }
  ~WithoutBackwardContext() {
    if constexpr (HasErase<T>::value) {
      if (saved_) {
        T::set(key(), std::move(saved_));
      }
    }
  }
  WithoutBackwardContext(const WithoutBackwardContext&) = delete;
  WithoutBackwardContext& operator=(const WithoutBackwardContext&) = delete;

 private:
  static const std::string& key() {
    static const std::string k = "context";
    return k;
  }
  std::shared_ptr<c10::SafePyObject> saved_;
};

struct Entry {
  int64_t index = -1;
  int64_t ready = 0;
  int64_t launch = 0;
  int64_t done = 0;  // 0 until the all-reduce completed
  int64_t bytes = 0;
  uint64_t seq = 0;  // which write this slot holds (a late completion of an overwritten slot is dropped)
};

// Fixed capacity, allocated once. The training thread writes ready/launch, a comm thread writes
// done, the training thread drains; a mutex held for a few stores keeps them apart (uncontended:
// tens of ns, no GIL).
class Ring {
 public:
  explicit Ring(size_t capacity) : slots_(capacity) {}

  // A new bucket: its slot's sequence number (0: not recorded).
  uint64_t begin(int64_t index, int64_t ready, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_) {
      return 0;
    }
    if (head_ - tail_ >= slots_.size()) {
      ++tail_;  // full (nobody drains): the oldest entry goes, memory stays bounded
      ++dropped_;
    }
    uint64_t seq = ++head_;  // sequence numbers start at 1
    Entry& e = slots_[seq % slots_.size()];
    e.index = index;
    e.ready = ready;
    e.launch = 0;
    e.done = 0;
    e.bytes = bytes;
    e.seq = seq;
    return seq;
  }

  void launched(uint64_t seq, int64_t t) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = slots_[seq % slots_.size()];
    if (e.seq == seq) {
      e.launch = t;
    }
  }

  void done(uint64_t seq, int64_t t) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = slots_[seq % slots_.size()];
    if (e.seq == seq) {
      e.done = t;
    }
  }

  // Every entry written since the last drain, in order, into ``out`` (no allocation for up to its
  // inline size); done is 0 for an all-reduce still in flight. The entries stay: a look at the
  // buckets of a backward still in progress (the hang watchdog's).
  template <typename Out>
  void peek(Out& out) {
    std::lock_guard<std::mutex> lock(mu_);
    copy(out);
  }

  // ``peek`` and the backward end, under one lock, both taken: the ring is empty afterwards and
  // the backward end 0 (returned; 0: not stamped). The drain of every step (``drain_into``).
  template <typename Out>
  int64_t take(Out& out) {
    std::lock_guard<std::mutex> lock(mu_);
    copy(out);
    tail_ = head_;
    const int64_t t = backward_end_;
    backward_end_ = 0;
    return t;
  }

  // The parameters (TensorImpl addresses, Python's Tensor._cdata) of each bucket seen while
  // layout capture was on; captured only at the steps Python asks for (the first ones).
  void want_layout(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    want_layout_ = on;
  }

  bool wants_layout() {
    std::lock_guard<std::mutex> lock(mu_);
    return want_layout_;
  }

  void add_layout(int64_t index, std::vector<int64_t> params) {
    std::lock_guard<std::mutex> lock(mu_);
    layout_.emplace_back(index, std::move(params));
  }

  std::vector<std::tuple<int64_t, std::vector<int64_t>>> take_layout() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::tuple<int64_t, std::vector<int64_t>>> out;
    out.swap(layout_);
    return out;
  }

  void set_enabled(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    enabled_ = on;
  }

  uint64_t dropped() {
    std::lock_guard<std::mutex> lock(mu_);
    return dropped_;
  }

  // Backward compute end, stamped by an autograd final callback that the first bucket of each
  // graph task (each backward, and each reentrant one inside it) queues: ``queue_end`` says
  // whether ``task`` has its callback queued already, ``end`` stamps (the last callback wins: an
  // outer backward ends after the reentrant ones inside it). Off (``stamp_ends``) where Python
  // stamps the backward end itself (compiled autograd may trace the graph).
  bool queue_end(int64_t task) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stamp_ends_ || task == queued_task_) {
      return false;
    }
    queued_task_ = task;
    return true;
  }

  void end(int64_t t) {
    std::lock_guard<std::mutex> lock(mu_);
    backward_end_ = t;
  }

  void stamp_ends(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    stamp_ends_ = on;
  }

  // The backward end stamped and not drained yet (0: none); read only.
  int64_t backward_end() {
    std::lock_guard<std::mutex> lock(mu_);
    return backward_end_;
  }

  size_t capacity() const {
    return slots_.size();
  }

 private:
  template <typename Out>
  void copy(Out& out) {  // (mu_ held)
    for (uint64_t seq = tail_ + 1; seq <= head_; ++seq) {
      out.push_back(slots_[seq % slots_.size()]);
    }
  }

  std::mutex mu_;
  std::vector<Entry> slots_;
  uint64_t head_ = 0;  // last sequence number written
  uint64_t tail_ = 0;  // last sequence number drained
  uint64_t dropped_ = 0;
  bool enabled_ = true;
  bool want_layout_ = false;
  bool stamp_ends_ = true;
  int64_t queued_task_ = -1;  // the graph task whose backward-end callback was queued last
  int64_t backward_end_ = 0;
  std::vector<std::tuple<int64_t, std::vector<int64_t>>> layout_;
};

// A Python hook to hand every bucket to instead: a user's hook registered after this one, timed
// by ddpdoctor's Python comm hook (the reducer takes one hook, so this one passes them on). Kept
// apart from the ring: completion callbacks on the comm thread hold the ring, never this, so no
// Python object is ever released there.
class Delegate {
 public:
  void set(std::shared_ptr<c10d::PythonCommHook> hook) {
    std::lock_guard<std::mutex> lock(mu_);
    hook_ = std::move(hook);
  }

  std::shared_ptr<c10d::PythonCommHook> get() {
    std::lock_guard<std::mutex> lock(mu_);
    return hook_;
  }

 private:
  std::mutex mu_;
  std::shared_ptr<c10d::PythonCommHook> hook_;
};

// What Python holds: the ring and the delegate slot the hook on the reducer shares.
struct Handle {
  std::shared_ptr<Ring> ring;
  std::shared_ptr<Delegate> delegate;
};

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

// A packed mark that is not there: an all-reduce not seen complete (None in the lists).
constexpr int64_t kPackedNone = INT64_MIN;
// int64s per bucket in ``OpenStep.packed``: ready, launch, done.
constexpr Py_ssize_t kPackedFields = 3;

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

// -- the optimizer step's start and end -------------------------------------------------------
//
// torch's global optimizer step pre- and post-hooks, as C++ callables: each call stamps the
// monotonic clock into a short log that Python takes at the monitor's next forward, where the
// same rule as before decides which step the stamps belong to (StepRecorder.optimizer_start and
// optimizer_end, given the instants). So the optimizer step costs no Python entry: two of the
// four a step took on the training thread, each paying for caches the optimizer left cold.
// The log keeps the first kOptEvents events since the last take (the rule uses the first start
// and end after the backward); ``running`` (a start without its end: the hang watchdog's
// "optimizer" phase) is read without taking.
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

// -- a sampled step's per-parameter gradient arrival ---------------------------------------------
//
// On sampled steps the checks want, per reduced parameter, whether its gradient arrived and when
// (unused parameters; the bucket what-if's per-parameter ready times). Python's
// register_post_accumulate_grad_hook would do, but a tensor keeps the C++ hook that calls its
// Python hooks for good once one was registered: after the first sample, every backward took the
// GIL once per parameter to call an empty dict of hooks (about 0.6 us a parameter here). This puts
// a C++ pre-hook on each parameter's gradient accumulator (the node DDP itself hooks) when a
// sample begins and takes it off when the sample ends: nothing is left behind, no GIL is taken.
// The instant is when the gradient reaches the accumulator (before it is added to .grad).

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

struct Arrivals {
  std::mutex mu;
  std::vector<int64_t> at;  // per parameter given: ns of the last arrival, 0 until one
};

class ArrivalStamp : public UntracedPreHook {
 public:
  ArrivalStamp(std::shared_ptr<Arrivals> arrivals, size_t slot) : arrivals_(std::move(arrivals)), slot_(slot) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    const int64_t t = now_ns();
    std::lock_guard<std::mutex> lock(arrivals_->mu);
    arrivals_->at[slot_] = t;
    return grads;
  }

 private:
  std::shared_ptr<Arrivals> arrivals_;
  size_t slot_;
};

// One sample: the hooks it added (node, hook) and what they saw. ``end`` (or the destructor)
// takes every hook off again.
class ParamSample {
 public:
  explicit ParamSample(const std::vector<at::Tensor>& params) : arrivals_(std::make_shared<Arrivals>()) {
    arrivals_->at.assign(params.size(), 0);
    hooked_.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.defined() || !p.requires_grad() || !p.is_leaf()) {
        continue;  // no accumulator: never seen (Python gives only leaves requiring grad)
      }
      auto node = torch::autograd::impl::grad_accumulator(p);
      if (!node) {
        continue;
      }
      auto hook = std::make_unique<ArrivalStamp>(arrivals_, i);
      torch::autograd::FunctionPreHook* raw = hook.get();
      node->add_pre_hook(std::move(hook));
      hooked_.emplace_back(std::move(node), raw);
    }
  }

  ~ParamSample() {
    remove();
  }

  ParamSample(const ParamSample&) = delete;
  ParamSample& operator=(const ParamSample&) = delete;

  // Takes the hooks off and returns, per parameter given, the last arrival (ns, plus ``offset``),
  // None where none came. Idempotent: a second call returns what the first saw.
  py::list end(int64_t offset) {
    remove();
    std::vector<int64_t> at;
    {
      std::lock_guard<std::mutex> lock(arrivals_->mu);
      at = arrivals_->at;
    }
    py::list out(at.size());
    for (size_t i = 0; i < at.size(); ++i) {
      out[i] = at[i] != 0 ? py::object(py::int_(at[i] + offset)) : py::object(py::none());
    }
    return out;
  }

 private:
  void remove() {
    for (auto& [node, raw] : hooked_) {
      auto& hooks = node->pre_hooks();
      for (auto it = hooks.begin(); it != hooks.end(); ++it) {
        if (it->get() == raw) {
          hooks.erase(it);
          break;
        }
      }
    }
    hooked_.clear();
  }

  using NodePtr = std::decay_t<decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()))>;
  std::shared_ptr<Arrivals> arrivals_;
  std::vector<std::pair<NodePtr, torch::autograd::FunctionPreHook*>> hooked_;
};

// -- DDP's own scaling, bit for bit ---------------------------------------------------------------
//
// Without a comm hook, DDP's reducer scales each gradient as it hands it to its bucket: it
// multiplies by the reciprocal of its divisor as it copies a gradient in, and divides in place a
// dense gradient that already is its bucket view (gradient_as_bucket_view=True with gradients
// kept between steps) and every sparse gradient. With a hook registered it only copies, and the
// hook scales. A multiply by the reciprocal and a divide give other bits whenever the divisor is
// not a power of two (world size 3, 6, 12, 24...), so ``DdpScale`` replays DDP's choice per
// gradient. The divisor is the reducer's own: the world size, or under
// Join(divide_by_initial_world_size=False) the ranks still training, which DDP counts in each
// forward. The reducer has no accessor for it, so its private member is read through an explicit
// instantiation (which the language exempts from access checks); native_cache.source_text
// defines DDPDOCTOR_REDUCER_DIV_FACTOR only where torch's reducer.hpp declares that member, and
// without it the divisor is the world size (and Python says the Join case is not honoured).

#ifdef DDPDOCTOR_REDUCER_DIV_FACTOR
template <typename Tag, typename Tag::type Member>
struct Expose {
  friend typename Tag::type member_of(Tag) {
    return Member;
  }
};
struct DivFactor {
  using type = int c10d::Reducer::*;
  friend type member_of(DivFactor);
};
template struct Expose<DivFactor, &c10d::Reducer::div_factor_>;
constexpr bool kReadsDivisor = true;
#else
constexpr bool kReadsDivisor = false;
#endif

bool power_of_two(int64_t n) {
  return n > 0 && (n & (n - 1)) == 0;
}

// Per reduced parameter, whether its gradient stays its bucket view through the backward's
// accumulation (DDP then divides it in place): known only before the accumulation, so a pre-hook
// on each parameter's gradient accumulator records there the storage of the .grad that the
// accumulation will keep (none where it makes a new tensor), with the round it belongs to. A
// round ends when the bucket flagged last is scaled. The first pre-hook of a round records every
// parameter's .grad as it is then, before any accumulation: a parameter this backward does not
// use (find_unused_parameters, static_graph) keeps that record, and DDP, which marks it ready
// without accumulating, divides it only where that .grad already is its bucket view (a tensor the
// script set is copied, and multiplied). A parameter with no record of the round (none taken: a
// watch made mid-round) is taken as its bucket view. A round in which no pre-hook ran at all
// (compiled autograd traced the backward: it runs no C++ hook of ours) takes every gradient as
// copied, as before.
//
// No lock: each pre-hook writes its own parameter's words (the first of a round, claimed by one
// compare-exchange, writes every parameter's before its own), and DDP's reducer takes its mutex
// after each accumulation and around the hook that reads them, which orders the two.
struct GradRecords {
  explicit GradRecords(size_t n) : seen(new std::atomic<uint64_t>[n]), kept(new std::atomic<uintptr_t>[n]) {
    for (size_t i = 0; i < n; ++i) {
      seen[i].store(0, std::memory_order_relaxed);
      kept[i].store(0, std::memory_order_relaxed);
    }
  }
  std::atomic<uint64_t> round{1};
  std::atomic<uint64_t> any_seen{0};  // the last round in which a pre-hook ran
  std::unique_ptr<std::atomic<uint64_t>[]> seen;   // per parameter: the round of its record
  std::unique_ptr<std::atomic<uintptr_t>[]> kept;  // per parameter: the kept .grad's storage, or 0
  std::unordered_map<const c10::TensorImpl*, size_t> slot;  // (written at construction only)
  // per parameter, not owned (a closed monitor's scale keeps no weights alive; written at
  // construction only)
  std::vector<std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>>> params;

  // Every parameter's .grad as the round begins (the first pre-hook of the round, before its own
  // record): what DDP compares with the bucket view for a parameter it marks ready unaccumulated.
  void take_all(uint64_t round) {
    for (size_t i = 0; i < params.size(); ++i) {
      auto impl = params[i] ? params[i]->lock() : c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>();
      if (!impl.defined()) {
        continue;  // (no record: taken as the bucket's view, as before)
      }
      const at::Tensor param(std::move(impl));
      const at::Tensor& grad = param.mutable_grad();
      const bool strided = grad.defined() && grad.layout() == c10::kStrided;
      kept[i].store(strided ? reinterpret_cast<uintptr_t>(grad.storage().unsafeGetStorageImpl()) : 0,
                    std::memory_order_relaxed);
      seen[i].store(round, std::memory_order_relaxed);
    }
  }
};

class GradRecord : public UntracedPreHook {
 public:
  GradRecord(std::shared_ptr<GradRecords> records, at::Tensor param, size_t slot)
      : records_(std::move(records)), param_(std::move(param)), slot_(slot) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    // AccumulateGrad adds into an existing dense .grad in place unless the backward builds a
    // graph (create_graph: grad mode on), which makes a new tensor, as a missing .grad does.
    // (mutable_grad: the accessor without grad()'s checks, which cost more than the rest here)
    const at::Tensor& grad = param_.mutable_grad();
    const bool kept = grad.defined() && grad.layout() == c10::kStrided && !at::GradMode::is_enabled();
    const uint64_t round = records_->round.load(std::memory_order_relaxed);
    uint64_t last = records_->any_seen.load(std::memory_order_relaxed);
    if (last != round && records_->any_seen.compare_exchange_strong(last, round, std::memory_order_relaxed)) {
      records_->take_all(round);  // the round's first pre-hook
    }
    const auto storage = kept ? reinterpret_cast<uintptr_t>(grad.storage().unsafeGetStorageImpl()) : 0;
    records_->kept[slot_].store(storage, std::memory_order_relaxed);
    records_->seen[slot_].store(round, std::memory_order_relaxed);
    return grads;
  }

 private:
  std::shared_ptr<GradRecords> records_;
  at::Tensor param_;  // (the accumulator holds its variable too: no cycle, the meta's link is weak)
  size_t slot_;
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

class GradWatch {
 public:
  explicit GradWatch(const std::vector<at::Tensor>& params) : records_(std::make_shared<GradRecords>(params.size())) {
    records_->params.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.defined() || !p.requires_grad() || !p.is_leaf()) {
        continue;
      }
      auto node = torch::autograd::impl::grad_accumulator(p);
      if (!node) {
        continue;
      }
      records_->slot.emplace(p.unsafeGetTensorImpl(), i);
      records_->params[i].emplace(p.getIntrusivePtr());
      auto hook = std::make_unique<GradRecord>(records_, p, i);
      torch::autograd::FunctionPreHook* raw = hook.get();
      node->add_pre_hook(std::move(hook));
      hooked_.emplace_back(Unowned<NodeRef>::type(node), raw);
    }
  }

  ~GradWatch() {
    for (auto& [weak, raw] : hooked_) {
      auto node = weak.lock();
      if (!node) {
        continue;  // gone with DDP's reducer, and our hook with it
      }
      auto& hooks = node->pre_hooks();
      for (auto it = hooks.begin(); it != hooks.end(); ++it) {
        if (it->get() == raw) {
          hooks.erase(it);
          break;
        }
      }
    }
  }

  GradWatch(const GradWatch&) = delete;
  GradWatch& operator=(const GradWatch&) = delete;

  // Per gradient of ``bucket`` (its parameters' order): 1 where DDP would divide it in place. The
  // storage is compared as DDP's is_alias_of does: a kept gradient that is not this bucket's view
  // (a tensor the script set as .grad) is copied, and multiplied.
  std::vector<char> in_place(c10d::GradBucket& bucket) {
    const auto params = bucket.getParameters();
    const c10::StorageImpl* storage = bucket.getBufferRef().storage().unsafeGetStorageImpl();
    std::vector<char> out(params.size(), 0);
    const uint64_t round = records_->round.load(std::memory_order_relaxed);
    if (records_->any_seen.load(std::memory_order_relaxed) != round) {
      return out;  // no pre-hook ran this round (compiled autograd): every gradient as copied
    }
    for (size_t j = 0; j < params.size(); ++j) {
      const at::Tensor& grad = params[j].grad();
      if (!grad.defined() || grad.storage().unsafeGetStorageImpl() != storage) {
        continue;  // no gradient (the bucket holds zeros) or not a view of this bucket
      }
      auto it = records_->slot.find(params[j].unsafeGetTensorImpl());
      if (it == records_->slot.end() || records_->seen[it->second].load(std::memory_order_relaxed) != round) {
        out[j] = 1;  // no record this round: taken as the gradient it had, kept as the bucket's view
        continue;
      }
      out[j] = records_->kept[it->second].load(std::memory_order_relaxed) == reinterpret_cast<uintptr_t>(storage) ? 1 : 0;
    }
    return out;
  }

  // After the bucket flagged last (every bucket's, whatever its scaling asked): the next round.
  void end_round() {
    records_->round.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::shared_ptr<GradRecords> records_;
  // The accumulators, not held: DDP's reducer holds them (each holds its parameter), and the
  // scale may outlive the model (in a closed monitor the script keeps).
  std::vector<std::pair<Unowned<NodeRef>::type, torch::autograd::FunctionPreHook*>> hooked_;
};

// A bucket of at most this many elements is scaled by ``multiply_checked`` below in one go; a
// larger one in pieces of this size over the intra-op threads (torch's own grain size).
constexpr int64_t kSmallBucket = 32768;

// ``data[i] *= s`` over ``n`` elements, a 32-byte vector at a time (GCC and Clang vector types):
// per element the IEEE product of the same two operands that torch's ``mul_`` kernel forms, so
// the same bits. True where some element was NaN or infinite: checked in the same pass (``x - x``
// is +0 for every finite ``x`` and NaN otherwise, so the OR of its bits is 0 exactly when all are
// finite: a subtract and an OR a vector, off the multiply's path, an OR's latency on the chain).
template <typename T>
inline __attribute__((always_inline)) bool multiply_lanes(T* data, int64_t n, T s) {
  int64_t i = 0;
  bool bad = false;
#if defined(__GNUC__) || defined(__clang__)
  using Bits = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef T Lanes __attribute__((vector_size(32)));
  typedef Bits BitLanes __attribute__((vector_size(32)));
  constexpr int64_t kLanes = 32 / sizeof(T);
  Lanes factor;
  for (int64_t k = 0; k < kLanes; ++k) {
    factor[k] = s;
  }
  BitLanes seen = {};
  for (; i + kLanes <= n; i += kLanes) {
    Lanes v;
    std::memcpy(&v, data + i, sizeof v);
    const Lanes zero_or_nan = v - v;
    BitLanes bits;
    std::memcpy(&bits, &zero_or_nan, sizeof bits);
    seen |= bits;
    v *= factor;
    std::memcpy(data + i, &v, sizeof v);
  }
  for (int64_t k = 0; k < kLanes; ++k) {
    bad = bad || seen[k] != 0;
  }
#endif
  for (; i < n; ++i) {
    const T x = data[i];
    bad = bad || (x - x) != T(0);
    data[i] = x * s;
  }
  return bad;
}

// Whether any of ``n`` elements is NaN or infinite (the same test, read only): a bucket DDP
// divides in place (``div_``), checked after its scaling.
template <typename T>
inline __attribute__((always_inline)) bool any_nonfinite_lanes(const T* data, int64_t n) {
  int64_t i = 0;
  bool bad = false;
#if defined(__GNUC__) || defined(__clang__)
  using Bits = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef T Lanes __attribute__((vector_size(32)));
  typedef Bits BitLanes __attribute__((vector_size(32)));
  constexpr int64_t kLanes = 32 / sizeof(T);
  BitLanes seen = {};
  for (; i + kLanes <= n; i += kLanes) {
    Lanes v;
    std::memcpy(&v, data + i, sizeof v);
    const Lanes zero_or_nan = v - v;
    BitLanes bits;
    std::memcpy(&bits, &zero_or_nan, sizeof bits);
    seen |= bits;
  }
  for (int64_t k = 0; k < kLanes; ++k) {
    bad = bad || seen[k] != 0;
  }
#endif
  for (; i < n; ++i) {
    bad = bad || (data[i] - data[i]) != T(0);
  }
  return bad;
}

// Built twice on x86-64 Linux with GCC, picked at load by the CPU (AVX2 where it has it, as
// torch's own kernels are): the build may be shared by the hosts of a cluster, so nothing beyond
// the baseline is assumed. A small bucket: 2.4 µs for five of 13,107 floats with AVX2, against
// 7.3 through ``mul_`` and 5.0 in 16-byte vectors (this project's VM).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define DDPDOCTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DDPDOCTOR_CLONES
#endif

DDPDOCTOR_CLONES bool multiply_floats(float* data, int64_t n, float s) {
  return multiply_lanes<float>(data, n, s);
}

DDPDOCTOR_CLONES bool multiply_doubles(double* data, int64_t n, double s) {
  return multiply_lanes<double>(data, n, s);
}

DDPDOCTOR_CLONES bool nonfinite_floats(const float* data, int64_t n) {
  return any_nonfinite_lanes<float>(data, n);
}

DDPDOCTOR_CLONES bool nonfinite_doubles(const double* data, int64_t n) {
  return any_nonfinite_lanes<double>(data, n);
}

// A plain CPU buffer that the loops above may read and write: contiguous, float or double, and
// nothing of autograd's or of a lazy view's on it.
bool plain_cpu_buffer(const at::Tensor& buffer) {
  const at::ScalarType dtype = buffer.scalar_type();
  return buffer.device().is_cpu() && buffer.is_contiguous() && !buffer.is_inference() && !buffer.is_conj() &&
         !buffer.is_neg() && !buffer.requires_grad() && (dtype == at::kFloat || dtype == at::kDouble);
}

// What a multiply of a bucket found: not done (not a plain CPU buffer), every element finite, or
// some NaN or infinite one.
enum class Scaled { kNotDone, kFinite, kNonFinite };

// ``multiply`` over ``data[0, n)``: at once for a small bucket, split over the intra-op threads
// for a larger one; true when any element was not finite.
template <typename T>
bool multiply_split(T* data, int64_t n, T s, bool (*multiply)(T*, int64_t, T)) {
  if (n <= kSmallBucket) {
    return multiply(data, n, s);
  }
  std::atomic<bool> any{false};
  at::parallel_for(0, n, kSmallBucket, [&](int64_t begin, int64_t end) {
    if (multiply(data + begin, end - begin, s)) {
      any.store(true, std::memory_order_relaxed);
    }
  });
  return any.load();
}

// ``buffer.mul_(1 / divisor)`` for a contiguous float or double buffer on the CPU, without the
// dispatcher and TensorIterator: their microsecond and a half a call is most of what scaling a
// model of small buckets costs a step (DDP itself scales as it copies the gradients in, which a
// comm hook cannot). A bucket larger than ``kSmallBucket`` elements is split over the intra-op
// threads at torch's own grain size, as ``mul_`` splits it. The version counter moves as
// ``mul_`` moves it. The non-finite check rides the same pass.
Scaled multiply_checked(at::Tensor& buffer, double scale) {
  if (!plain_cpu_buffer(buffer)) {
    return Scaled::kNotDone;
  }
  const int64_t n = buffer.numel();
  const bool bad = buffer.scalar_type() == at::kFloat
                       ? multiply_split(buffer.data_ptr<float>(), n, static_cast<float>(scale), multiply_floats)
                       : multiply_split(buffer.data_ptr<double>(), n, scale, multiply_doubles);
  buffer.unsafeGetTensorImpl()->bump_version();
  return bad ? Scaled::kNonFinite : Scaled::kFinite;
}

// Whether ``tensor`` (a bucket, after a scaling that was not ``multiply_checked``'s) holds a NaN
// or an infinity: the loops above where they apply, torch's kernels otherwise.
bool any_nonfinite(const at::Tensor& tensor) {
  if (tensor.layout() != c10::kStrided || !at::isFloatingType(tensor.scalar_type())) {
    return false;  // (sparse gradients are not looked at; integers are always finite)
  }
  if (plain_cpu_buffer(tensor)) {
    return tensor.scalar_type() == at::kFloat ? nonfinite_floats(tensor.data_ptr<float>(), tensor.numel())
                                              : nonfinite_doubles(tensor.data_ptr<double>(), tensor.numel());
  }
  return !at::isfinite(tensor).all().item<bool>();
}

// 1/``size`` as DDP's reducer passes it to its multiply: a double scalar tensor marked as a wrapped
// number (so the bucket's dtype wins and the product is taken in its math type). Not
// ``mul_(double)``: C++'s Scalar overload rounds the reciprocal to a half-precision bucket's dtype
// first (bfloat16 and float16 gradients then differ whenever the size is not a power of 2).
at::Tensor wrapped_scale(int64_t size) {
  at::Tensor scale = c10::scalar_to_tensor(at::Scalar(1.0 / static_cast<double>(size)));
  scale.unsafeGetTensorImpl()->set_wrapped_number(true);
  return scale;
}

class DdpScale {
 public:
  DdpScale(const std::shared_ptr<c10d::Reducer>& reducer, int64_t world_size, const std::vector<at::Tensor>& params,
           bool watch)
      : reducer_(reducer), world_size_(world_size), divisor_(world_size), scale_(wrapped_scale(world_size)) {
    if (watch) {
      watch_ = std::make_unique<GradWatch>(params);
    }
  }

  // Scales ``bucket`` in place as DDP's reducer would have scaled its gradients; where a flag is
  // watched (``watch_nonfinite``), notes a bucket holding a NaN or an infinity.
  void apply(c10d::GradBucket& bucket) {
    std::lock_guard<std::mutex> lock(mu_);
    const bool bad = scale(bucket);
    if (bad && flag_.defined()) {
      note_nonfinite(bucket);
    }
    if (watch_ != nullptr && bucket.isLast()) {
      watch_->end_round();
    }
  }

  // Where to say that a bucket held a NaN or an infinity: ``flag`` (a one-element int64 CPU
  // tensor that Python reads as a plain word, one read a step) is set to 1 and the bucket's
  // details kept for ``take_nonfinite``. An undefined tensor (None) stops the watch.
  void watch_nonfinite(std::optional<at::Tensor> flag) {
    std::lock_guard<std::mutex> lock(mu_);
    if (flag && flag->defined()) {
      TORCH_CHECK(flag->device().is_cpu() && flag->scalar_type() == at::kLong && flag->numel() == 1 &&
                      flag->is_contiguous(),
                  "watch_nonfinite: a one-element int64 CPU tensor");
      flag_ = *flag;
    } else {
      flag_ = at::Tensor();
    }
  }

  // The buckets noted since the last take, in order: (bucket index, [(parameter's TensorImpl
  // address, NaN count, infinity count)] for each of its gradients that is not finite).
  std::vector<std::tuple<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t>>>> take_nonfinite() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::tuple<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t>>>> out;
    out.swap(nonfinite_);
    return out;
  }

  // The divisor DDP's reducer uses this round (the world size where it cannot be read).
  int64_t divisor() const {
#ifdef DDPDOCTOR_REDUCER_DIV_FACTOR
    if (auto reducer = reducer_.lock()) {
      const int div = (*reducer).*member_of(DivFactor());
      if (div > 0) {
        return div;
      }
    }
#endif
    return world_size_;
  }

  bool watches() const {
    return watch_ != nullptr;
  }

 private:
  // Scales the bucket; true where it holds a NaN or an infinity (looked at only while a flag is
  // watched: the multiply's own pass on a CPU bucket, a read after ``div_`` otherwise).
  bool scale(c10d::GradBucket& bucket) {
    at::Tensor& buffer = bucket.getBufferRef();
    const bool look = flag_.defined();
    const int64_t div = divisor();
    if (buffer.layout() != c10::kStrided) {
      buffer.div_(div);  // a sparse gradient: DDP divides it
      return false;
    }
    if (div == 1 && buffer.is_cuda()) {
      // by 1.0 no bit changes on a GPU (CUDA kernels keep subnormals), and that pass over every
      // gradient is what a scaling comm hook costs there; on CPU it stays (flush_denormal)
      return look && any_nonfinite(buffer);
    }
    if (div != divisor_) {
      divisor_ = div;
      scale_ = wrapped_scale(div);
    }
    const double reciprocal = 1.0 / static_cast<double>(div);  // (the value scale_ holds)
    if (watch_ == nullptr || power_of_two(div)) {
      // (dividing by a power of two gives the same bits)
      return multiply(buffer, reciprocal, look);
    }
    const std::vector<char> in_place = watch_->in_place(bucket);
    const bool all = std::all_of(in_place.begin(), in_place.end(), [](char c) { return c != 0; });
    const bool none = std::none_of(in_place.begin(), in_place.end(), [](char c) { return c != 0; });
    if (none) {
      return multiply(buffer, reciprocal, look);
    }
    if (all) {
      buffer.div_(div);
    } else {
      const std::vector<at::Tensor> views = bucket.getGradients();
      for (size_t j = 0; j < views.size() && j < in_place.size(); ++j) {
        at::Tensor view = views[j];
        if (in_place[j]) {
          view.div_(div);
        } else {
          view.mul_(scale_);
        }
      }
    }
    return look && any_nonfinite(buffer);
  }

  // ``buffer`` times ``reciprocal`` (``multiply_checked``, else torch's ``mul_``); true where it
  // holds a NaN or an infinity and ``look``.
  bool multiply(at::Tensor& buffer, double reciprocal, bool look) {
    const Scaled done = multiply_checked(buffer, reciprocal);
    if (done != Scaled::kNotDone) {
      return look && done == Scaled::kNonFinite;
    }
    buffer.mul_(scale_);
    return look && any_nonfinite(buffer);
  }

  // A bucket found not finite: the flag set, and which of its gradients are not, with their NaN
  // and infinity counts (torch's kernels: this runs once in a broken run, not every step).
  // Bounded: what Python has not taken stops growing at ``kNonFiniteKept`` buckets.
  void note_nonfinite(c10d::GradBucket& bucket) {
    flag_.data_ptr<int64_t>()[0] = 1;
    if (nonfinite_.size() >= kNonFiniteKept) {
      return;
    }
    const std::vector<at::Tensor> views = bucket.getGradients();
    const auto params = bucket.getParameters();
    std::vector<std::tuple<int64_t, int64_t, int64_t>> bad;
    for (size_t j = 0; j < views.size() && j < params.size(); ++j) {
      const at::Tensor& view = views[j];
      if (!at::isFloatingType(view.scalar_type())) {
        continue;
      }
      const int64_t nan = at::isnan(view).sum().item<int64_t>();
      const int64_t inf = at::isinf(view).sum().item<int64_t>();
      if (nan != 0 || inf != 0) {
        bad.emplace_back(reinterpret_cast<int64_t>(params[j].unsafeGetTensorImpl()), nan, inf);
      }
    }
    nonfinite_.emplace_back(static_cast<int64_t>(bucket.getIndex()), std::move(bad));
  }

  static constexpr size_t kNonFiniteKept = 64;
  std::mutex mu_;
  std::weak_ptr<c10d::Reducer> reducer_;  // (the reducer owns the hook that owns this: not held)
  const int64_t world_size_;
  int64_t divisor_;
  at::Tensor scale_;
  std::unique_ptr<GradWatch> watch_;
  at::Tensor flag_;  // (undefined: non-finite buckets are not looked for)
  std::vector<std::tuple<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t>>>> nonfinite_;
};

class TimedAllReduceHook
    : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  TimedAllReduceHook(
      const c10::intrusive_ptr<c10d::ProcessGroup>& group,
      std::shared_ptr<Ring> ring,
      std::shared_ptr<Delegate> delegate,
      std::shared_ptr<DdpScale> scale)
      : c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>>(group),
        ring_(std::move(ring)),
        delegate_(std::move(delegate)),
        scale_(std::move(scale)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    const int64_t ready = now_ns();
    if (auto delegate = delegate_->get()) {
      return delegate->runHook(bucket);  // takes the GIL itself, as DDP's Python hooks do
    }
    at::Tensor& buffer = bucket.getBufferRef();
    const auto index = static_cast<int64_t>(bucket.getIndex());
    const uint64_t seq = ring_->begin(index, ready, static_cast<int64_t>(buffer.numel() * buffer.element_size()));
    if (seq != 0 && ring_->wants_layout()) {
      std::vector<int64_t> params;
      for (const auto& p : bucket.getParameters()) {
        params.push_back(reinterpret_cast<int64_t>(p.unsafeGetTensorImpl()));
      }
      ring_->add_layout(index, std::move(params));
    }
    // with a hook registered DDP copies the gradients unscaled: scaled here as it would have
    scale_->apply(bucket);
    std::vector<at::Tensor> tensors = {buffer};
    WithoutBackwardContext<at::impl::ThreadLocalPythonObjects> no_context;
    auto fut = state_->allreduce(tensors)->getFuture();
    if (seq == 0) {
      return fut;
    }
    ring_->launched(seq, now_ns());
    std::shared_ptr<Ring> ring = ring_;
    // The first bucket of a backward queues the callback that stamps its compute end. Queued
    // now, it runs before DDP's finalize_backward, which DDP queues once its last bucket is
    // launched (after this). Outside a backward (a joined rank's shadow all-reduce under Join)
    // there is no graph task and nothing is queued.
    const int64_t task = torch::autograd::get_current_graph_task_id();
    if (task >= 0 && ring->queue_end(task)) {
      torch::autograd::Engine::get_default_engine().queue_callback([ring]() { ring->end(now_ns()); });
    }
    // Runs on the comm library's thread when the all-reduce completes; DDP waits on the returned
    // future, so every done stamp is written before DDP's finalize_backward returns.
    return fut->then(
        [ring, seq](c10::ivalue::Future& f) -> c10::IValue {
          ring->done(seq, now_ns());
          return f.value();
        },
        fut->elementType());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isPyObject()) {
      if (auto delegate = delegate_->get()) {
        return delegate->parseHookResult(result);
      }
    }
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  std::shared_ptr<Ring> ring_;
  std::shared_ptr<Delegate> delegate_;
  const std::shared_ptr<DdpScale> scale_;
};

// Registers the timed hook on DDP's reducer; the reducer owns it from then on (a reducer takes
// one hook, for good: a later hook is handed the buckets through Ring::delegate). Raises DDP's
// own "can only be called once" error if a hook is registered already. ``scale`` (None: one that
// watches no gradient) scales each bucket as DDP would.
Handle register_timed_hook(
    const std::shared_ptr<c10d::Reducer>& reducer,
    const c10::intrusive_ptr<c10d::ProcessGroup>& group,
    int64_t capacity,
    std::shared_ptr<DdpScale> scale) {
  TORCH_CHECK(capacity > 0, "ring capacity must be positive");
  if (scale == nullptr) {  // (the benches': DDP's divisor, gradients taken as copied)
    scale = std::make_shared<DdpScale>(reducer, group->getSize(), std::vector<at::Tensor>{}, false);
  }
  Handle handle{std::make_shared<Ring>(static_cast<size_t>(capacity)), std::make_shared<Delegate>()};
  reducer->register_comm_hook(std::make_unique<TimedAllReduceHook>(group, handle.ring, handle.delegate, std::move(scale)));
  return handle;
}

// Whether pybind takes these objects as a reducer and a process group here (checked at attach,
// before anything is registered, so a mismatch means the Python route from the start).
bool accepts(const std::shared_ptr<c10d::Reducer>& reducer, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return reducer != nullptr && group.defined();
}

int64_t clock_ns() {
  return now_ns();
}

// Whether each tensor's requires_grad is the byte ``expected`` holds for it (1: True): the check
// of every training forward (SampledChecks) in one call, no Python attribute read per parameter.
// False as well for a length mismatch or an item that is not a tensor (Python then reads them).
bool same_requires_grad(const py::list& tensors, const py::bytes& expected) {
  char* flags = nullptr;
  Py_ssize_t n = 0;
  if (PyBytes_AsStringAndSize(expected.ptr(), &flags, &n) != 0) {
    throw py::error_already_set();
  }
  if (n != static_cast<Py_ssize_t>(PyList_GET_SIZE(tensors.ptr()))) {
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyList_GET_ITEM(tensors.ptr(), i);
    if (!THPVariable_Check(obj) || THPVariable_Unpack(obj).requires_grad() != (flags[i] != 0)) {
      return false;
    }
  }
  return true;
}

// The exact fingerprint of one tensor, its bits (``fingerprints.tensor_bits``): the sum of its
// elements' bit patterns, each read as an integer of the element's width (1 byte unsigned; 2, 4 and
// 8 bytes signed), modulo 2**64, folded to 53 bits (``fingerprints.fold_bits``). Integer addition
// is associative, so the value is the same whatever order the elements are added in: a rank with
// more intra-op threads, other vector instructions or the Python route gets the same value, where
// ATen's float sum of a large tensor differs in its last bits (ranks are compared for equality).
template <typename Word>
uint64_t word_sum(const void* data, int64_t n) {
  const Word* w = static_cast<const Word*>(data);
  // four running sums (unsigned: wrapping is defined), so the loop vectorizes
  uint64_t a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += static_cast<uint64_t>(static_cast<int64_t>(w[i]));
    b += static_cast<uint64_t>(static_cast<int64_t>(w[i + 1]));
    c += static_cast<uint64_t>(static_cast<int64_t>(w[i + 2]));
    d += static_cast<uint64_t>(static_cast<int64_t>(w[i + 3]));
  }
  for (; i < n; ++i) {
    a += static_cast<uint64_t>(static_cast<int64_t>(w[i]));
  }
  return a + b + c + d;
}

int64_t fold_bits(uint64_t sum) {
  return static_cast<int64_t>((sum ^ (sum >> 53)) & ((uint64_t{1} << 53) - 1));
}

int64_t tensor_bits(const at::Tensor& t) {
  if (t.is_sparse() || t.is_complex() || t.numel() == 0 || t.is_quantized()) {
    return 0;
  }
  // a dense tensor without overlaps (contiguous, channels_last, a transpose) holds its elements in
  // numel slots from its first; another (an expanded or sliced view) is copied first
  const at::Tensor dense = t.is_non_overlapping_and_dense() ? t : t.contiguous();
  const char* data = static_cast<const char*>(dense.const_data_ptr());
  const int64_t size = dense.element_size();
  uint64_t (*sum)(const void*, int64_t) = nullptr;
  switch (size) {
    case 1:
      sum = &word_sum<uint8_t>;
      break;
    case 2:
      sum = &word_sum<int16_t>;
      break;
    case 4:
      sum = &word_sum<int32_t>;
      break;
    case 8:
      sum = &word_sum<int64_t>;
      break;
    default:
      return 0;
  }
  // split across the intra-op threads as ATen splits its own sums (the order does not matter)
  const uint64_t total = at::parallel_reduce(
      int64_t{0}, dense.numel(), at::internal::GRAIN_SIZE, uint64_t{0},
      [&](int64_t begin, int64_t end, uint64_t) { return sum(data + begin * size, end - begin); },
      [](uint64_t a, uint64_t b) { return a + b; });
  return fold_bits(total);
}

// What ``float_pass`` reads from a tensor.
struct FloatPass {
  double squares = 0.0;
  double sum = 0.0;
  uint64_t bits = 0;
};

// One pass over a floating-point tensor's elements: the sum of their squares and their sum, and
// their bits (``word_sum``'s). Blocks of ``kBlock`` elements are summed in float32 over eight lanes
// (a loop that vectorizes), each block's sums added into double; the block's words are summed
// while it is still in the first-level cache, so memory is read once.
template <typename T, typename Word>
FloatPass float_pass(const char* data, int64_t n) {
  static_assert(sizeof(T) == sizeof(Word), "an element is read as a word of its width");
  constexpr int64_t kBlock = 1024;
  constexpr int kLanes = 8;
  FloatPass out;
  const T* x = reinterpret_cast<const T*>(data);
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t m = std::min(kBlock, n - start);
    const T* block = x + start;
    float q[kLanes] = {};
    float s[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= m; i += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float v = static_cast<float>(block[i + k]);
        q[k] += v * v;
        s[k] += v;
      }
    }
    double qd = 0.0;
    double sd = 0.0;
    for (int k = 0; k < kLanes; ++k) {
      qd += q[k];
      sd += s[k];
    }
    for (; i < m; ++i) {
      const double v = static_cast<double>(static_cast<float>(block[i]));
      qd += v * v;
      sd += v;
    }
    out.squares += qd;
    out.sum += sd;
    out.bits += word_sum<Word>(block, m);
  }
  return out;
}

// Tensors up to this many elements are read by ``float_pass``: there the three operator calls a
// tensor (norm, sum, bits) cost more than the pass, and cold, at a sampled step, far more (the
// 18 tensors of the hot-path bench's MLP: 32 µs a fingerprint before, 21 after). Above it ATen's
// kernels, vectorized for the machine's widest instructions, read faster than this portable loop.
constexpr int64_t kFloatPassMax = 32768;

// ``float_pass`` over a float32, float16 or bfloat16 tensor (copied first where it is not dense);
// false for another dtype (the caller takes ATen's kernels). In one call: up to ``kFloatPassMax``
// elements, ATen would not split the work across its intra-op threads either.
bool small_float_pass(const at::Tensor& t, FloatPass& out) {
  FloatPass (*pass)(const char*, int64_t) = nullptr;
  switch (t.scalar_type()) {
    case at::kFloat:
      pass = &float_pass<float, int32_t>;
      break;
    case at::kHalf:
      pass = &float_pass<c10::Half, int16_t>;
      break;
    case at::kBFloat16:
      pass = &float_pass<c10::BFloat16, int16_t>;
      break;
    default:
      return false;
  }
  const at::Tensor dense = t.is_non_overlapping_and_dense() ? t : t.contiguous();
  out = pass(static_cast<const char*>(dense.const_data_ptr()), dense.numel());
  return true;
}

// The fingerprint of each tensor (SampledChecks, at sampled steps): its L2 norm and its bits
// (above), which is what ranks are compared by; the sum of each tensor from ``sums_from`` on (the
// buffers). Zeros for a sparse, complex or empty tensor. A small float32, float16 or bfloat16
// tensor is read once (``float_pass``), its norm and sum given as float32: the values
// ``fingerprints.float_values`` gives to float32 rounding (summed in another order), the bits
// equal. Another tensor takes ATen's kernels, as the Python route does. In Python, five operator
// calls a tensor cost 1.1 ms for the 58 tensors of an 8-layer BatchNorm MLP.
std::tuple<std::vector<double>, std::vector<double>, std::vector<int64_t>> tensor_values(
    const std::vector<at::Tensor>& tensors, int64_t sums_from) {
  at::NoGradGuard no_grad;
  std::vector<double> norms;
  std::vector<double> sums;
  std::vector<int64_t> bits;
  norms.reserve(tensors.size());
  bits.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const bool summed = static_cast<int64_t>(i) >= sums_from;
    if (t.is_sparse() || t.is_complex() || t.numel() == 0) {
      norms.push_back(0.0);
      if (summed) {
        sums.push_back(0.0);
      }
      bits.push_back(0);
      continue;
    }
    FloatPass pass;
    if (!t.is_quantized() && t.device().is_cpu() && t.numel() <= kFloatPassMax && small_float_pass(t, pass)) {
      norms.push_back(static_cast<double>(static_cast<float>(std::sqrt(pass.squares))));
      if (summed) {
        sums.push_back(static_cast<double>(static_cast<float>(pass.sum)));
      }
      bits.push_back(fold_bits(pass.bits));
      continue;
    }
    // no detach: nothing is recorded under the guard; the 0-dim results are read in place
    // (``item`` is one more operator call each)
    const at::Tensor f = t.to(at::kFloat);
    const at::Tensor norm = at::linalg_vector_norm(f, 2);
    norms.push_back(static_cast<double>(*norm.const_data_ptr<float>()));
    if (summed) {
      const at::Tensor sum = f.sum();
      sums.push_back(static_cast<double>(*sum.const_data_ptr<float>()));
    }
    bits.push_back(tensor_bits(t));
  }
  return {std::move(norms), std::move(sums), std::move(bits)};
}

// -- the step record, built in C++ --------------------------------------------------------------
//
// StepRecorder._emit_step's host-clock branch, for the steps emitted together on short steps: the
// same arithmetic on the same doubles (offsets from t0 as (mark - t0) / 1000.0, sums in order), so
// the record is equal field for field to the one Python builds (tests/test_step_build.py compares
// them). In Python this was most of the step record's cost: a list comprehension per bucket column
// and a dozen attribute reads, on every step.

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

// -- Column: a step record's bucket column, packed ------------------------------------------------
//
// The records built in C++ hold their per-bucket offsets (b_ready_us, b_launch_us, b_done_us) as a
// Column: one object of doubles (NaN for None), read-only, where a list held a float object per
// bucket. A record is built in a batch of closed steps and freed a hundred steps later by the live
// window, both with cold caches, and its float objects were most of that: allocated, counted, freed
// one by one (BENCHMARKS.md). A Column reads as a list does (len, index, slice, iteration, ``in``,
// ``==`` with a list, repr); ``tolist()`` gives the list, which is what the log's encoder writes
// (``events.codec``) and what a copy or a pickle of it becomes. Not tracked by the cyclic GC: it
// holds no object.

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
    return py::list();  // (an empty column: see new_column)
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
  if (n == 0) {  // (an empty column: see new_column)
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

// -- calls without pybind11's dispatcher ---------------------------------------------------------
//
// The calls made at every step are plain CPython functions (METH_FASTCALL): the drain, the
// optimizer's two stamps and their take, the requires_grad check and the record's build. They run
// after the backward and the optimizer step, when the instruction and data caches are cold, and
// pybind11's dispatcher (overload records, argument loaders, the keep-alive stack) is a lot of code
// to fetch: on this project's 2-core VM, with the caches flushed before each call, a pybind11 call
// of two arguments took 5.2-6.1 us and the same as a plain function 2.7-3.6 us (warm: 0.29 against
// 0.16-0.19 us). A method's state is a capsule of a shared_ptr, the function's ``self``: nothing of
// pybind11 is on the call's path. Each takes its arguments by position only.

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

// Timing.drain_into(step, offset)
PyObject* raw_drain_into(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("drain_into(step, offset)", n, 2);
    return drain_into(held<Ring>(self), args[0], int_arg(args[1]));
  });
}

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

// same_requires_grad(tensors, expected)
PyObject* raw_same_requires_grad(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("same_requires_grad(tensors, expected)", n, 2);
    if (!PyList_Check(args[0]) || !PyBytes_Check(args[1])) {
      throw py::type_error("same_requires_grad(tensors, expected): a list and bytes");
    }
    return py::object(py::bool_(same_requires_grad(py::reinterpret_borrow<py::list>(args[0]),
                                                   py::reinterpret_borrow<py::bytes>(args[1]))));
  });
}

// build_step(step, cls, rank, ddp, clock)
PyObject* raw_build_step(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return guarded([&] {
    expect_args("build_step(step, cls, rank, ddp, clock)", n, 5);
    return build_step(args[0], args[1], args[2], args[3], args[4]);
  });
}

PyMethodDef kDrainInto = {"drain_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_drain_into)),
                          METH_FASTCALL,
                          "drain_into(step, offset): the ring's stamps of the last backward into the OpenStep "
                          "(None), or their columns where Python must place them"};
PyMethodDef kStampStart = {"pre", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_stamp_start)),
                           METH_FASTCALL, "an optimizer step's start (torch's global optimizer pre-hook)"};
PyMethodDef kStampEnd = {"post", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_stamp_end)),
                         METH_FASTCALL, "an optimizer step's end (torch's global optimizer post-hook)"};
PyMethodDef kTakeInto = {"take_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raw_take_into)),
                         METH_FASTCALL,
                         "take_into(step, offset): the stamps since the last take set on the step (None), or "
                         "returned as take returns them"};
// -- a new step, built here -------------------------------------------------------------------
//
// ``step_opener(OpenStep)``: a function ``open(index, t0, offset, synced)`` that returns what
// ``OpenStep(index, t0)`` does (step_recorder.py), with ``fwd_start = t0`` and
// ``synced_forward = True`` where ``synced``: the routine forward's new step. The slots are written
// at their offsets (read once from the class's slot descriptors), with no Python frame and no
// attribute lookup: OpenStep.__init__ is 25 lines, run cold once a step. ``t0_mono_ns`` and
// ``t0_wall_ns`` are read here on the same clocks (perf_counter's CLOCK_MONOTONIC, time_ns's
// CLOCK_REALTIME), plus ``offset`` (the tests' shifted clock, as clocks.mono_ns adds it).
// ``tests/test_native_hook.py`` compares every slot with Python's.

// Sets a slot that holds NULL (a fresh object) to a new reference; ``value`` NULL: the error set.
void put(PyObject* obj, Py_ssize_t offset, PyObject* value) {
  if (value == nullptr) {
    throw py::error_already_set();
  }
  *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset) = value;
}

int64_t wall_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

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

// -- the routine forward's change of step, in one call ---------------------------------------------
//
// ``step_changer(timing, stamps, cls)``: a function ``change(step, index, offset, same_bytes)`` for
// the routine forward (Monitor.on_forward_pre), doing what its calls did one after the other: the
// ring's marks into ``step`` (drain_packed), the optimizer's stamps (take_into), ``step`` ended now
// (an optimizer step whose closure runs this forward keeps no start: it is still running), and the
// next step opened at the same instant (an OpenStep ``cls``, as step_opener's, synchronizing). Returns the
// new OpenStep. Where the drain gives columns (out of order) or the stamps their events (not the
// common case), returns them at once (a tuple, a list), nothing ended or opened: the full path
// goes on from there. Each call after the backward costs a cold entry; this is one.

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

// -- the compact log's per-step arithmetic (sinks.compact, on the log writer's thread) ------------
//
// The writer judges every step's phases against their running medians, and writes the steps
// between anomalies as a window's rows, in columns of whole µs. In Python that was most of the
// writer's CPU: 19-22 µs a step in a 2-rank run of the short model, three times its warm cost, on
// a thread that shares the ranks' cores and their training threads' GIL (BENCHMARKS.md). These
// two functions do the same arithmetic on the same objects and give the same values;
// ``sinks.compact`` keeps its Python for everything else (and where the extension does not load),
// and ``tests/test_compact_log.py`` holds both to the same bytes.

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
