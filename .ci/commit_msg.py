"""Checks a commit message the way the project writes them: a subject of at most 72 characters,
then a blank line and a body that says why. Run by pre-commit at the commit-msg stage
(``pre-commit install --hook-type commit-msg``), or by hand: ``python3 .ci/commit_msg.py FILE``."""

from __future__ import annotations

import sys
from pathlib import Path

SUBJECT_MAX = 72


def problems(message: str) -> list[str]:
    """What is wrong with ``message`` (git's comment lines left out); empty when it is fine."""
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or not lines[0].strip():
        return ["the message is empty"]
    found = []
    if len(lines[0]) > SUBJECT_MAX:
        found.append(f"the subject is {len(lines[0])} characters; at most {SUBJECT_MAX}")
    if lines[0].startswith(("Merge ", "Revert ")):
        return found
    if len(lines) < 3 or lines[1].strip():
        found.append("a blank line and a body that says why must follow the subject")
    return found


def main(argv: list[str]) -> int:
    wrong = problems(Path(argv[1]).read_text(encoding="utf-8"))
    for line in wrong:
        print(f"commit message: {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
