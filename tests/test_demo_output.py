"""What a new user sees from ``ddpdoctor demo`` in a fresh venv: no noise from torch about numpy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _without_numpy(tmp_path: Path) -> dict[str, str]:
    """An environment where ``import numpy`` fails as it does when numpy is not installed."""
    stub = tmp_path / "no-numpy" / "numpy"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPDOCTOR_", "TORCHELASTIC_", "PYTHONWARNINGS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(stub.parent), str(ROOT)])
    return env


def test_the_demo_output_has_no_numpy_warning(tmp_path: Path) -> None:
    env = _without_numpy(tmp_path)
    # the stub does what a missing numpy does: torch warns at import
    plain = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True, timeout=120)
    assert "Failed to initialize NumPy" in plain.stderr
    demo = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpdoctor",
            "demo",
            "--headless",
            "--ranks",
            "2",
            "--steps",
            "6",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "ddpdoctor report" in demo.stdout
    assert "NumPy" not in demo.stdout + demo.stderr
