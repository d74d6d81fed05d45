"""A real headless Chromium driven over the DevTools protocol, for the HTML report tests.

``open_page(path)`` starts Debian's ``chromium`` (as root: ``--no-sandbox``), loads a local file,
and returns what the page did: console errors, uncaught exceptions, every request it made, a
screenshot, and the value of a JavaScript expression. The browser runs with a throwaway profile
and with its own background networking off, so any request seen is the page's own.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
]


def chromium() -> str | None:
    """The chromium executable, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageResult:
    console_errors: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL requested (the page's own file included)
    failed: list[str] = field(default_factory=list)
    value: Any = None  # the probe expression's result
    screenshot: bytes = b""  # PNG of the whole page
    clips: list[bytes] = field(default_factory=list)  # PNGs of the regions ``clips`` named, at 1/4 scale


class _Cdp:
    def __init__(self, ws_url: str) -> None:
        import websocket  # websocket-client

        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        my_id = self.next_id
        self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            if "method" in msg:
                self.events.append(msg)

    def wait_event(self, method: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        for ev in self.events:
            if ev["method"] == method:
                return ev
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            msg = json.loads(self.ws.recv())
            if "method" in msg:
                self.events.append(msg)
                if msg["method"] == method:
                    return msg
        raise TimeoutError(method)

    def close(self) -> None:
        self.ws.close()


def _devtools_port(profile: Path, proc: subprocess.Popen[bytes], timeout: float) -> int:
    """Chromium writes the port it picked (``--remote-debugging-port=0``) to DevToolsActivePort."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}")
        if marker.exists():
            first = marker.read_text().split("\n", 1)[0].strip()
            if first.isdigit():
                return int(first)
        time.sleep(0.05)  # polling a file the browser writes once; bounded by the deadline
    raise TimeoutError("chromium did not open its DevTools port")


def open_page(
    path: Path,
    probe: str,
    width: int = 1280,
    height: int = 4000,
    timeout: float = 60.0,
    settle: str = "true",
    clips: str = "[]",
) -> PageResult:
    """Load ``path`` in headless chromium and report what happened.

    ``settle`` is a JavaScript expression polled until true (e.g. all plots drawn) before the
    probe is evaluated and the screenshot taken. ``clips`` evaluates to a list of
    ``{x, y, width, height}`` page regions, each captured on its own at 1/4 scale (small enough to
    read back in pure Python).
    """
    exe = chromium()
    if exe is None:
        raise RuntimeError("chromium is not installed")
    profile = Path(tempfile.mkdtemp(prefix="ddpdoctor-chromium-"))
    proc = subprocess.Popen(
        [
            exe,
            *FLAGS,
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            f"--window-size={width},{height}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    cdp: _Cdp | None = None
    try:
        port = _devtools_port(profile, proc, timeout)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            targets = json.loads(resp.read())
        page = next(t for t in targets if t.get("type") == "page")
        cdp = _Cdp(page["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Log", "Network"):
            cdp.call(f"{domain}.enable")
        cdp.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        cdp.call("Page.navigate", url=path.resolve().as_uri())
        cdp.wait_event("Page.loadEventFired", timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = cdp.call("Runtime.evaluate", expression=settle, returnByValue=True)
            if done.get("result", {}).get("value") is True:
                break
            time.sleep(0.1)  # plots draw asynchronously after load; bounded by the deadline
        result = PageResult()
        result.value = cdp.call("Runtime.evaluate", expression=probe, returnByValue=True)["result"].get("value")
        shot = cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        result.screenshot = base64.b64decode(shot["data"])
        regions = cdp.call("Runtime.evaluate", expression=clips, returnByValue=True)["result"].get("value") or []
        for r in regions:
            part = cdp.call(
                "Page.captureScreenshot",
                format="png",
                captureBeyondViewport=True,
                clip={"x": r["x"], "y": r["y"], "width": r["width"], "height": r["height"], "scale": 0.25},
            )
            result.clips.append(base64.b64decode(part["data"]))
        for ev in cdp.events:
            method, params = ev["method"], ev.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                result.console_errors.append(
                    " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                )
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                result.console_errors.append(params["entry"].get("text", ""))
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                result.exceptions.append(details.get("exception", {}).get("description") or details.get("text", ""))
            elif method == "Network.requestWillBeSent":
                result.requests.append(params["request"]["url"])
            elif method == "Network.loadingFailed":
                result.failed.append(params.get("errorText", ""))
        return result
    finally:
        if cdp is not None:
            cdp.close()
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


# -- a minimal PNG reader (8-bit RGB/RGBA, not interlaced: what chromium's screenshots are) -----------


def png_pixels(data: bytes) -> tuple[int, int, int, bytes]:
    """(width, height, channels, raw pixel rows without filter bytes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    height = depth = ctype = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    channels = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    out = bytearray(height * stride)
    prev = bytearray(stride)
    for y in range(height):
        filt = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - channels] if x >= channels else 0
            b = prev[x]
            c = prev[x - channels] if x >= channels else 0
            if filt == 1:
                line[x] = (line[x] + a) & 0xFF
            elif filt == 2:
                line[x] = (line[x] + b) & 0xFF
            elif filt == 3:
                line[x] = (line[x] + (a + b) // 2) & 0xFF
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        out[y * stride : (y + 1) * stride] = line
        prev = line
    return width, height, channels, bytes(out)


def coloured_fraction(data: bytes) -> float:
    """Share of a PNG's pixels that are not grey: a plot area with only its background and grid
    lines (white, greys) gives 0; drawn traces (coloured lines, bars, heatmap cells) do not."""
    width, height, ch, px = png_pixels(data)
    coloured = 0
    for i in range(0, width * height * ch, ch):
        r, g, b = px[i], px[i + 1], px[i + 2]
        if max(r, g, b) - min(r, g, b) > 24:
            coloured += 1
    return coloured / max(1, width * height)
