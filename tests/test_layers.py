"""Layer rules of DESIGN.md, enforced: what each layer may import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ddpdoctor"

# layer -> top-level modules it must never import (directly)
FORBIDDEN = {
    "events": {"torch", "textual", "rich", "ddpdoctor.sinks", "ddpdoctor.runtime", "ddpdoctor.runlog",
               "ddpdoctor.analysis", "ddpdoctor.cli"},
    "sinks": {"torch", "textual", "rich", "ddpdoctor.runtime", "ddpdoctor.runlog", "ddpdoctor.analysis", "ddpdoctor.cli"},
    "runtime": {"textual", "rich", "ddpdoctor.runlog", "ddpdoctor.cli"},
    "runlog": {"torch", "textual", "rich", "ddpdoctor.sinks", "ddpdoctor.runtime", "ddpdoctor.analysis", "ddpdoctor.cli"},
    "analysis": {"torch", "textual", "rich", "ddpdoctor.sinks", "ddpdoctor.runtime", "ddpdoctor.cli"},
    "cli": {"textual", "rich"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(layer: str) -> None:
    bad = []
    for path in sorted((PKG / layer).rglob("*.py")):
        for name in _imports(path):
            for forbidden in FORBIDDEN[layer]:
                if name == forbidden or name.startswith(forbidden + "."):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_only_the_tui_imports_textual() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
                 if any(n == "textual" or n.startswith("textual.") for n in _imports(p))]
    assert offenders == []


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120)
    return set(out.stdout.split())


def test_import_ddpdoctor_pulls_in_neither_textual_rich_nor_torch() -> None:
    mods = _modules_after("import ddpdoctor")
    assert not {m for m in mods if m.split(".")[0] in {"textual", "rich", "torch"}}


def test_reading_and_reporting_run_without_torch() -> None:
    mods = _modules_after("import ddpdoctor.analysis, ddpdoctor.runlog, ddpdoctor.events, ddpdoctor.cli.main, "
                          "ddpdoctor.cli.report_cmd")
    assert "torch" not in mods


def test_tui_installs_under_a_namespaced_name() -> None:
    mods = _modules_after("import ddpdoctor_tui")
    assert "ddpdoctor_tui" in mods and "tui" not in mods
