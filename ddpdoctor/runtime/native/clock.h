// The clocks of every mark the extension takes: steady_clock, CLOCK_MONOTONIC on Linux (the clock of
// Python's time.perf_counter_ns), and system_clock for a new step's wall time (time.time_ns).
//
// Python twin: ddpdoctor/runtime/step/clocks.py (mono_ns, wall_ns, HostClock.now): the same OS clocks.
// Parity test: tests/test_native_hook.py::test_native_clock_is_perf_counter.
// Twin kept: no rule is copied, each language reads the OS clock itself.

#pragma once

#include <chrono>
#include <cstdint>

namespace {

// steady_clock is CLOCK_MONOTONIC on Linux: the clock of Python's time.perf_counter_ns().
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t wall_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t clock_ns() {
  return now_ns();
}

}  // namespace
