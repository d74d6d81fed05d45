"""The native extension's C++ source: ``bindings.cpp`` and one header a concern, each naming its
Python twin and the test that holds the two together; built as one translation unit
(``native_cache.source_text``) and loaded by ``runtime.step.native_hook``.

``python -m ddpdoctor.runtime.native [--verbose]`` builds it (or finds it cached) and prints how
long building and loading took.
"""
