"""ddpdoctor's exceptions form one tree (``ddpdoctor.errors``) and keep their builtin bases."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import ddpdoctor
from ddpdoctor.errors import DDPDoctorError, InputError, OutputError, SetupError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "ddpdoctor", ROOT / "tui" / "ddpdoctor_tui")


def _exception_classes() -> list[type[BaseException]]:
    """Every exception class defined at module level in the project's packages."""
    found = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
            if not names:
                continue
            dotted = ".".join(path.relative_to(package.parent).with_suffix("").parts)
            if "native" in dotted.split(".") and path.name != "native_hook.py":
                continue
            module = importlib.import_module(dotted)
            for name in names:
                cls = getattr(module, name)
                if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, Warning):
                    found.append(cls)
    return found


def test_every_exception_of_the_project_is_a_ddpdoctor_error() -> None:
    classes = _exception_classes()
    assert len(classes) >= 9, [c.__name__ for c in classes]
    outside = [f"{c.__module__}.{c.__name__}" for c in classes if not issubclass(c, DDPDoctorError)]
    assert not outside, f"exceptions outside ddpdoctor.errors' tree: {outside}"


def test_groups_keep_the_builtin_each_error_always_was() -> None:
    from ddpdoctor.events.codec import CorruptLine
    from ddpdoctor.runlog import RunDirError
    from ddpdoctor.sinks.base import SinkError

    assert issubclass(RunDirError, InputError) and issubclass(RunDirError, ValueError)
    assert issubclass(CorruptLine, InputError) and issubclass(CorruptLine, ValueError)
    assert issubclass(SinkError, OutputError) and issubclass(SinkError, OSError)
    # the base is importable from the package itself, without loading torch
    assert ddpdoctor.DDPDoctorError is DDPDoctorError
    assert ddpdoctor.SetupError is SetupError


def test_a_bad_run_dir_is_caught_as_a_ddpdoctor_error(tmp_path: Path) -> None:
    from ddpdoctor.runlog import load_run

    try:
        load_run(tmp_path / "no-such-run")
    except DDPDoctorError as exc:
        assert isinstance(exc, InputError)
        assert "no-such-run" in str(exc)
    else:
        raise AssertionError("a missing run dir was read without an error")
