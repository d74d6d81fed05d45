"""Make the screenshots of the README and the docs from a real run of the straggler demo.

    python docs/images/make_screenshots.py            # writes docs/images/watch.png, report.png

It trains ``ddpdoctor demo --scenario straggler --headless`` (two gloo ranks on CPU, the last
one's backward 40 ms slower) into a temporary run dir, opens ``ddpdoctor watch``'s app over the
run while it trains and saves its screen once the straggler is named, then writes the run's HTML
report. Both pages are drawn to PNG by headless Chromium (Debian's ``chromium``) from the SVG the
app saves and the report's HTML. Needs the repository importable (``pip install -e .``).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tui")]

from ddpdoctor_tui import WatchApp  # noqa: E402

SIZE = (132, 40)  # the terminal the view is drawn in, in cells
STEPS = 400
PACE_S = 0.05  # seconds between steps: slow enough for the view to follow, as in the live demo


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("headless Chromium is needed: apt-get install chromium")


def _to_png(page: Path, png: Path, width: int, height: int) -> None:
    """Draw ``page`` (SVG or HTML) at ``width`` x ``height`` CSS pixels into ``png``."""
    subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            "--virtual-time-budget=8000",  # plotly draws after load
            f"--window-size={width},{height}",
            f"--screenshot={png}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    print(f"wrote {png.relative_to(ROOT)}")


async def _watch_screen(run_dir: Path, svg: Path, timeout: float = 600.0) -> None:
    """Save the live view's screen once the straggler is named and a few steps are on screen."""
    app = WatchApp(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + timeout
        while True:
            await pilot.pause(0.5)
            screen = app.export_screenshot()
            steps = [int(s) for s in re.findall(r"step&#160;(\d+)", screen)]
            if "straggler" in screen and steps and max(steps) >= 80:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the live view never named the straggler")
        await pilot.pause(1.0)  # two more refreshes: the heatmap and the sparklines settle
        app.save_screenshot(filename=svg.name, path=str(svg.parent))


def _svg_size(svg: Path) -> tuple[int, int]:
    match = re.search(r'viewBox="0 0 ([\d.]+) ([\d.]+)"', svg.read_text(encoding="utf-8"))
    if match is None:
        raise ValueError(f"{svg} has no viewBox")
    return int(float(match.group(1))) + 1, int(float(match.group(2))) + 1


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-shots-") as tmp:
        os.chdir(tmp)  # the view and the report show the run dir as given: runs/straggler
        run_dir = Path("runs") / "straggler"
        cmd = [sys.executable, "-m", "ddpdoctor", "demo", "--scenario", "straggler", "--headless"]
        cmd += ["--steps", str(STEPS), "--pace", str(PACE_S), "--run-dir", str(run_dir)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tui")]))
        demo = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
        try:
            while not run_dir.is_dir():
                if demo.poll() is not None:
                    sys.exit(f"the demo exited ({demo.returncode}) before writing {run_dir}")
                time.sleep(0.2)
            svg = Path(tmp) / "watch.svg"
            asyncio.run(_watch_screen(run_dir, svg))
            demo.wait(timeout=300)
        finally:
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGTERM)
                demo.wait(timeout=30)
        width, height = _svg_size(svg)
        _to_png(svg, HERE / "watch.png", width, height)
        html = Path(tmp) / "report.html"  # (absolute: chromium is given a file:// URI)
        subprocess.run(
            [sys.executable, "-m", "ddpdoctor", "report", str(run_dir), "--format", "html", "-o", str(html)],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        _to_png(html, HERE / "report.png", 1280, 1500)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
