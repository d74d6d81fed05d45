"""The commit-message check that pre-commit runs (``.ci/commit_msg.py``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "commit_msg.py"
_spec = importlib.util.spec_from_file_location("commit_msg", SCRIPT)
assert _spec is not None and _spec.loader is not None
commit_msg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(commit_msg)


def test_a_short_subject_with_a_body_passes_and_git_comments_are_ignored() -> None:
    assert commit_msg.problems("Stream: count refused connections\n\nThey were lost silently.\n# a comment\n") == []


def test_a_long_subject_or_a_missing_body_is_named() -> None:
    long = "x" * 73
    assert commit_msg.problems(f"{long}\n\nWhy.\n") == ["the subject is 73 characters; at most 72"]
    assert commit_msg.problems("Subject only\n") == ["a blank line and a body that says why must follow the subject"]
    assert commit_msg.problems("\n\n") == ["the message is empty"]
    # git's own merge subjects need no body
    assert commit_msg.problems("Merge branch 'topic'\n") == []


def test_the_script_exits_1_on_a_bad_message(tmp_path: Path) -> None:
    bad, good = tmp_path / "bad", tmp_path / "good"
    bad.write_text("y" * 90 + "\n")
    good.write_text("A subject\n\nA body.\n")
    run = [sys.executable, str(SCRIPT)]
    assert subprocess.run([*run, str(bad)], capture_output=True, timeout=60).returncode == 1
    assert subprocess.run([*run, str(good)], capture_output=True, timeout=60).returncode == 0
