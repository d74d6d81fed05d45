"""The finding codes' registry (``ddpdoctor.codes``) against the code that raises findings: a
code produced but not declared, or declared but produced nowhere, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from ddpdoctor.categories import DDPDoctorWarning
from ddpdoctor.codes import CODES, category_of

PKG = Path(__file__).resolve().parents[1] / "ddpdoctor"
#: The layers whose modules raise findings.
DETECTORS = ("analysis", "runtime")


def _modules() -> list[Path]:
    return sorted(p for layer in DETECTORS for p in (PKG / layer).rglob("*.py"))


def _produced_literals() -> dict[str, list[str]]:
    """Each string given as a finding's code, where the code says so plainly: ``code="..."`` in a
    call, or the first argument of ``Finding(...)``; with the places it is given."""
    found: dict[str, list[str]] = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            given = [kw.value for kw in node.keywords if kw.arg == "code"]
            if isinstance(node.func, ast.Name) and node.func.id == "Finding" and node.args:
                given.append(node.args[0])
            for value in given:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.setdefault(value.value, []).append(f"{path.relative_to(PKG)}:{node.lineno}")
    return found


def _string_literals() -> set[str]:
    return {
        node.value
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_every_code_a_detector_gives_is_declared() -> None:
    undeclared = {code: where for code, where in _produced_literals().items() if code not in CODES}
    assert not undeclared, f"codes produced but not declared in ddpdoctor/codes.py: {undeclared}"


def test_every_declared_code_is_produced_somewhere() -> None:
    literals = _string_literals()
    never = sorted(name for name in CODES if name not in literals)
    assert not never, f"codes declared in ddpdoctor/codes.py that no detector produces: {never}"


def test_each_code_declares_what_its_readers_need() -> None:
    for name, code in CODES.items():
        assert code.name == name
        assert issubclass(code.category, DDPDoctorWarning)
        assert code.severity in ("info", "warning", "error")
        assert code.title and not code.title.endswith(".")
        assert code.raised, name
        assert code.anchor.endswith(f"#{name}")
        assert category_of(name) is code.category
    # a code this version does not know (a newer rank's log) still gets ddpdoctor's base category
    assert category_of("a-code-from-a-newer-version") is DDPDoctorWarning
