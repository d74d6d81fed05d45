"""What a new user sees from ``ddpdoctor demo`` in a fresh venv: no noise from torch about numpy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import without_numpy


def test_the_demo_output_has_no_numpy_warning(
    tmp_path: Path, headless_demo: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    env = without_numpy(tmp_path)
    # the stub does what a missing numpy does: torch warns at import
    plain = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True, timeout=120)
    assert "Failed to initialize NumPy" in plain.stderr
    # the session's headless demo ran with the same stub (tests/conftest.py)
    _, demo = headless_demo
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "ddpdoctor report" in demo.stdout
    assert "NumPy" not in demo.stdout + demo.stderr
