"""The native comm hook's build: its name and where it is cached, known without importing torch.

The name holds the Python and torch versions and the source's hash, so another torch or another
source never loads a stale build (torch's extension directory is shared by every torch of a
Python). The ranks compute it from the imported torch (``runtime.step.native_hook``). ``ddpdoctor
run`` and ``ddpdoctor demo`` compute the same name from torch's version file, without importing
torch (seconds), so that a cached build costs a launch nothing; when anything here differs from
what the ranks will compute, the lookup finds nothing and the launcher asks a child process that
imports torch, as before.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from ddpdoctor.events import environment

#: The folder of the native comm hook's C++ source: ``bindings.cpp`` and the headers it includes.
SOURCE_DIR = Path(__file__).parent / "runtime" / "native"
#: The one translation unit built (``source_text`` puts the headers it includes in it).
SOURCE = SOURCE_DIR / "bindings.cpp"
#: Written into the build directory once a build is complete (a killed build leaves none).
OK_MARK = "ddpdoctor-built"
#: The compiler's flags: a release build, as torch itself is. torch's extension builder defines
#: no NDEBUG, and without it pybind11 checks the GIL at every reference count change and at
#: every call (thread-local lookups each: a tenth of the step record's build), and torch's headers
#: keep their debug-only assertions. (Nothing in torch's headers changes a class's layout with
#: it.) Part of the name's hash: a build with other flags is another build.
CFLAGS = ("-O2", "-DNDEBUG")
#: Tests: ``compile`` makes the source fail to compile (a build failure, for real).
FAULT_ENV = environment.TEST_NATIVE_FAULT_ENV


#: Defined for the build where torch's reducer declares the member the hook reads DDP's divisor
#: from (``DdpScale`` in the source); the line is part of the source's hash.
DIVISOR_DEFINE = "#define DDPDOCTOR_REDUCER_DIV_FACTOR 1  // torch's reducer.hpp declares it\n"
_DIVISOR_MEMBER = re.compile(r"^\s*int div_factor_;", re.MULTILINE)


def reducer_declares_divisor() -> bool:
    """Whether the installed torch's ``reducer.hpp`` declares ``int div_factor_;`` (read from its
    headers, without importing torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    header = Path(next(iter(spec.submodule_search_locations))) / "include/torch/csrc/distributed/c10d/reducer.hpp"
    try:
        return _DIVISOR_MEMBER.search(header.read_text()) is not None
    except OSError:
        return False


#: ``SOURCE_DIR`` as the compiler's messages name it (from the package's parent)
_SOURCE_NAME = "ddpdoctor/runtime/native"
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"/]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


def _expanded(path: Path, seen: set[str]) -> list[str]:
    """``path``'s lines, each ``#include "x.h"`` of ``SOURCE_DIR`` replaced by that file's own
    lines the first time (later: an empty line, as ``#pragma once`` would), with a ``#line`` before
    and after each, so that the compiler names the file and line a message is about. The names are
    relative to the package's parent: the text, and so the build's name, is the same wherever
    ddpdoctor is installed."""
    name = f"{_SOURCE_NAME}/{path.name}"
    out = [f'#line 1 "{name}"']
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        include = _LOCAL_INCLUDE.match(line)
        header = SOURCE_DIR / include.group(1) if include else None
        if header is not None and header.is_file():  # (another: left to the compiler, which says so)
            if header.name not in seen:
                seen.add(header.name)
                out += _expanded(header, seen)
                out.append(f'#line {number + 1} "{name}"')
            else:
                out.append("")
        else:
            out.append("" if _PRAGMA_ONCE.match(line) else line)
    return out


def source_text() -> str:
    """The source to build: ``SOURCE`` with the headers it includes put in it (``_expanded``),
    with the divisor's define and the test fault, when asked. The extension's name hashes all of
    it, so a change in any header is another build."""
    text = "\n".join(_expanded(SOURCE, {SOURCE.name})) + "\n"
    if reducer_declares_divisor():
        text = DIVISOR_DEFINE + text
    if environment.read(FAULT_ENV) == "compile":
        text = '#include "ddpdoctor_test_missing_header.h"  // a source that does not compile\n' + text
    return text


def torch_tag(version: str, git_version: str | None) -> str:
    """The Python and torch versions, as the extension's name carries them."""
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}_{version}_{str(git_version or '')[:8]}"
    return "".join(c if c.isalnum() else "_" for c in tag)


def extension_name(text: str, tag: str) -> str:
    """The extension's name for source ``text`` built against the torch of ``tag`` (with
    ``CFLAGS``)."""
    digest = hashlib.sha256(f"{text}\n{' '.join(CFLAGS)}".encode()).hexdigest()[:12]
    return f"ddpdoctor_timed_hook_{tag}_{digest}"


def built(directory: Path, name: str) -> Path | None:
    """The shared object of a complete build of ``name`` in ``directory``, or None."""
    so = directory / f"{name}.so"
    return so if (directory / OK_MARK).exists() and so.exists() else None


def _torch_version_file() -> tuple[str, str | None] | None:
    """torch's ``__version__`` and ``git_version``, read from its ``version.py`` alone."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    values: dict[str, object] = {}
    # a generated file of plain assignments (its only import is ``typing``)
    exec(compile(path.read_text(), str(path), "exec"), values)
    version = values.get("__version__")
    git = values.get("git_version")
    return (version, git if isinstance(git, str) else None) if isinstance(version, str) else None


def _default_build_root() -> Path:
    """torch's default extension directory on Linux (``get_default_build_root``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.path.realpath(os.path.join(cache, "torch_extensions")))


def gpu_visible(environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> bool:
    """Whether a job started here would see a GPU (an NVIDIA device node, or ROCm's ``/dev/kfd``),
    found without importing torch. ``CUDA_VISIBLE_DEVICES`` hides them when its first entry names
    no device: CUDA reads the list up to the first entry that is not an index or a GPU or MIG
    UUID, so ``""``, ``-1`` and a scheduler's ``NoDevFiles`` all mean none.

    A job that trains on a GPU takes the Python route (its marks are CUDA events), so it has no
    use for the native build.
    """
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        if not (first.isdigit() or first.startswith(("GPU-", "MIG-"))):
            return False
    try:
        return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()
    except OSError:
        return False


def cached_build() -> Path | None:
    """The cached build the ranks would load, found without importing torch; None when there is
    none, or when this cannot tell (not Linux, no torch, an unreadable version file)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        found = _torch_version_file()
        if found is None:
            return None
        name = extension_name(source_text(), torch_tag(*found))
        return built(_default_build_root() / name, name)
    except Exception:  # noqa: BLE001 - any doubt: the launcher asks a process that imports torch
        return None
