"""The GPU attribution bench runs on CPU too (gloo, world size 1): each of its rows trains the same
bits as plain DDP, so a row's figure on a GPU measures what it says (GPU time is scarce: a bench
that broke meanwhile would waste it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ROWS = (
    "plain-2",
    "pyhook",
    "pyhook-noscale",
    "pyhook+events(timing=None)",
    "ddpdoctor",
    "ddpdoctor-host-marks",
    "ddpdoctor-nullsink",
    "ddpdoctor-quiet",
)


def test_gpu_attrib_rows_train_the_same_bits_on_cpu() -> None:
    cmd = [
        sys.executable,
        "bench/gpu_attrib.py",
        "--device",
        "cpu",
        "--model",
        "small",
        "--pairs",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--floor",
        "--threads",
        "--events",
        "--profile-steps",
        "0",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for row in ROWS:
        same = [ln for ln in lines if ln.startswith(f"{row} ") and "bit-identical to plain's" in ln]
        assert len(same) == 1 and same[0].endswith(": yes"), (row, done.stdout)
        assert any(ln.startswith(f"{row} ") and "ms/step" in ln for ln in lines), (row, done.stdout)
