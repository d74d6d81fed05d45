"""mkdocs hook: the findings reference's table of codes, built from the registry.

``ddpdoctor/codes.py`` declares every finding code (its category, severity, title, where it is
raised). The hook writes that table where ``<!-- codes-table -->`` stands in
``reference/findings.md`` and fails the build (``mkdocs build --strict``) when a code has no
``### `code` `` entry on any findings page.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ddpdoctor.codes import CODES

MARK = "<!-- codes-table -->"


def _documented(docs_dir: Path) -> set[str]:
    found: set[str] = set()
    for page in sorted((docs_dir / "reference").glob("findings*.md")):
        found.update(re.findall(r"^###\s+`([a-z0-9-]+)`", page.read_text(encoding="utf-8"), re.M))
    return found


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARK not in markdown:
        return markdown
    documented = _documented(Path(config["docs_dir"]))
    missing = sorted(set(CODES) - documented)
    if missing:
        raise SystemExit(f"findings reference: no entry for {', '.join(missing)}")
    rows = ["| code | what | severity at worst | warning category | raised in |", "|---|---|---|---|---|"]
    for name, code in CODES.items():
        where = ", ".join(w for w in ("script", "watch", "report") if w in code.raised)
        rows.append(f"| [`{name}`](#{name}) | {code.title} | {code.severity} | `{code.category.__name__}` | {where} |")
    return markdown.replace(MARK, "\n".join(rows))
