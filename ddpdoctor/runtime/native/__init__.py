"""The native comm hook's C++ source (``timed_hook.cpp``); built and loaded by ``runtime.step.native_hook``.

``python -m ddpdoctor.runtime.native [--verbose]`` builds it (or finds it cached) and prints how
long building and loading took.
"""
