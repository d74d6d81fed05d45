"""Example scripts run once per test session, for every test that reads the same run."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ZooRuns:
    """Example scripts (``examples/zoo/*.py``, ``examples/*.py``) run once per session as a user
    runs them: ``python SCRIPT RUN_DIR ARGS...`` from the project root. Tests that run the same
    script with the same arguments read the same real run (they only read it), instead of each
    starting their own three Python processes (a launcher and two gloo ranks)."""

    root: Path
    _done: dict[tuple[str, tuple[str, ...]], tuple[subprocess.CompletedProcess[str], Path]] = field(
        default_factory=dict
    )

    def run(
        self, script: Path, *args: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.CompletedProcess[str], Path]:
        """``(the finished process, its run dir)``; the run dir is fresh for every distinct run
        (``env``: variables set for this run, on top of the test's environment)."""
        key = (str(script), args + tuple(f"{k}={v}" for k, v in sorted((env or {}).items())))
        if key not in self._done:
            run_dir = self.root / f"{len(self._done):02d}-{script.stem}" / "run"
            run_dir.parent.mkdir(parents=True)
            argv = [sys.executable, str(script), str(run_dir), *args]
            full_env = {**os.environ, **env} if env else None
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT, env=full_env)
            self._done[key] = (proc, run_dir)
        return self._done[key]
