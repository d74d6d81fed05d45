"""What a stream receiver refused or lost, kept beside the rank files it wrote (``receiver.json``).

``ddpdoctor collect`` writes it when it stops; ``load_run`` reads it back into ``Run.receiver``
so the report can say that the run dir is incomplete, and why, instead of looking whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddpdoctor.events.health import SourceHealth

#: The file's name in the run dir (or attempt folder) the receiver wrote.
RECEIVER_FILE = "receiver.json"


def write_receiver_health(run_dir: Path, health: SourceHealth) -> None:
    """Write ``health`` as ``receiver.json`` in ``run_dir`` (atomically: a reader never sees half)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{RECEIVER_FILE}.tmp"
    tmp.write_text(json.dumps(health._asdict(), sort_keys=True) + "\n")
    os.replace(tmp, run_dir / RECEIVER_FILE)


def read_receiver_health(run_dir: Path) -> SourceHealth | None:
    """The counts a receiver left in ``run_dir`` (None: no receiver wrote this run dir, or unreadable)."""
    try:
        data = json.loads((run_dir / RECEIVER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    fields = {k: int(v) for k, v in data.items() if k in SourceHealth._fields and isinstance(v, int)}
    return SourceHealth(**{"corrupt_lines": 0, "unknown_lines": 0, "dropped": 0, **fields})
