"""Make docs/images/tensorboard.png: TensorBoard showing ddpdoctor's series of a demo run.

    python docs/screenshots/tensorboard.py            # from the repository root

Trains ``ddpdoctor demo --headless --scenario straggler`` (2 gloo ranks on CPU, the last rank's
backward slower), writes it with ``ddpdoctor export --tensorboard``, serves it with TensorBoard
on 127.0.0.1, and takes the screenshot of its Scalars dashboard in headless Chromium. Needs the
``tensorboard`` extra and a ``chromium`` on PATH.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ddpdoctor.cli.ports import free_port  # noqa: E402

OUTPUT = ROOT / "docs" / "images" / "tensorboard.png"
#: How long TensorBoard may take to answer, and the page to load its charts (virtual time).
START_S = 120.0
LOAD_MS = 30_000


def _wait_for(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tensorboard exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)  # a server starting up: poll again
    raise SystemExit(f"tensorboard did not answer at {url} within {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-shot-") as tmp:
        run_dir, logdir = Path(tmp) / "run", Path(tmp) / "tb"
        ddpdoctor = [sys.executable, "-m", "ddpdoctor"]
        demo = [*ddpdoctor, "demo", "--headless", "--scenario", "straggler", "--steps", str(args.steps)]
        subprocess.run([*demo, "--run-dir", str(run_dir)], check=True, stdout=subprocess.DEVNULL, timeout=600)
        subprocess.run([*ddpdoctor, "export", str(run_dir), "--tensorboard", str(logdir)], check=True, timeout=300)
        port = free_port()
        board = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
        server = subprocess.Popen([*board, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}/"
            _wait_for(url, server, START_S)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            shot = [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1600,1250",
                f"--virtual-time-budget={LOAD_MS}",
                f"--screenshot={args.output}",
                f"{url}#scalars",
            ]
            subprocess.run(shot, check=True, capture_output=True, timeout=300)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
