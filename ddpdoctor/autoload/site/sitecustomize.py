"""ddpdoctor's zero-code hook, loaded by every Python process that ``ddpdoctor run`` starts.

``ddpdoctor run`` puts this folder first on ``PYTHONPATH``, so Python's ``site`` imports this
module at start-up. It must cost next to nothing in processes that never train (the launcher,
pip, a shell script's helpers): it imports neither torch nor ddpdoctor, it only adds an import
hook that waits for ``torch.nn.parallel.distributed``. When that module is executed, the class
``DistributedDataParallel`` itself is patched, however the training script names or imports it.
A ``sitecustomize`` that was already on the path is still run (this one only shadows it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
from typing import Any

_TARGET = "torch.nn.parallel.distributed"


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then hands the fresh module to ddpdoctor.autoload.patch."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            from ddpdoctor.autoload import patch

            patch(module)
        except Exception as exc:  # noqa: BLE001 - never keep torch from importing
            _warn(exc)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, resource readers, ...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the one module it waits for."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _warn(exc: BaseException) -> None:
    import warnings

    message = (
        f"ddpdoctor run: could not hook DistributedDataParallel ({type(exc).__name__}: {exc}); "
        "training goes on unmonitored"
    )
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    except Warning:  # a filter made warnings errors (-W error): this runs inside torch's import
        sys.stderr.write(f"RuntimeWarning: {message}\n")


def _chain() -> None:
    """Run the sitecustomize this one shadows, if any, as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved_path = sys.path[:]
    me = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved_path
        other = sys.modules.get("sitecustomize")
        if other is None and me is not None:
            sys.modules["sitecustomize"] = me


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
_chain()
