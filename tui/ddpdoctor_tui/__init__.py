"""The Textual app behind ``ddpdoctor watch`` (the only layer that imports textual)."""

from __future__ import annotations

from ddpdoctor_tui.watch_app import WatchApp

__all__ = ["WatchApp"]
