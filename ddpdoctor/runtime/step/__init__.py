"""One step's timings on one rank: what runs on the training thread at every step.

Here: ``hooks`` (``StepHooks``: every probe torch or the comm library calls, forward pre and
post, buffer broadcast, bucket ready, backward end, optimizer, and the emission of the records),
``recorder`` (``StepRecorder``: turns those calls into Step and Layout records), ``clocks`` (host
and CUDA marks), ``comm_hook`` (the Python route's timed comm hook), ``native_hook`` (the native
route: building and loading the C++ extension, and ``NativeTiming``, its per-step Python side),
``optimizer_hooks`` (torch's global optimizer step hooks).

Not here: the checks sampled beside the timings (``runtime.checks``), the process's threads and
exit handling (``runtime.process``), the DDP surgery (``runtime.attach``), the C++ source
(``runtime.native``).
"""
