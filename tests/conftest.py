"""Fixtures shared across test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.zoo_runs import ZooRuns

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def native_built() -> Path:
    """Build (or find) the native extension once per pytest run; skip where it cannot build here."""
    from ddpdoctor.runtime.step import native_hook

    try:
        return native_hook.build()
    except native_hook.NativeUnavailable as exc:
        pytest.skip(f"the native comm hook cannot be built here: {exc}")


@pytest.fixture(scope="session")
def native_extension(native_built: Path) -> ModuleType:
    """The native extension, loaded in this process (skipped where it cannot build)."""
    from ddpdoctor.runtime.step import native_hook

    return native_hook.load()


@pytest.fixture(scope="session")
def zoo_runs(tmp_path_factory: pytest.TempPathFactory) -> ZooRuns:
    return ZooRuns(tmp_path_factory.mktemp("zoo-runs"))


def without_numpy(folder: Path) -> dict[str, str]:
    """An environment where ``import numpy`` fails as it does when numpy is not installed (a stub
    package under ``folder`` raises at import), without ddpdoctor's variables or warning filters."""
    stub = folder / "no-numpy" / "numpy"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPDOCTOR_", "TORCHELASTIC_", "PYTHONWARNINGS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(stub.parent), str(ROOT)])
    return env


#: ``ddpdoctor demo --headless`` as a new user runs it: 2 ranks, 8 steps.
DEMO_STEPS = 8


@pytest.fixture(scope="session")
def headless_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The pytest run's one ``ddpdoctor demo --headless --ranks 2 --steps 8`` run, as a user without
    numpy runs it (torch then warns at import, which the demo must filter): ``(run dir, the
    finished process)``. test_cli.py reads its run and output, test_demo_output.py its noise."""
    folder = tmp_path_factory.mktemp("demo")
    run_dir = folder / "run"
    argv = [sys.executable, "-m", "ddpdoctor", "demo", "--headless", "--ranks", "2", "--steps", str(DEMO_STEPS)]
    proc = subprocess.run(
        [*argv, "--run-dir", str(run_dir)],
        env=without_numpy(folder),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=folder,
    )
    return run_dir, proc
