"""Every environment variable ddpdoctor reads is declared once (``events.environment``), read
there alone, and listed in the commands reference."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ddpdoctor.events.environment import VARIABLES, read, turned_off

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "ddpdoctor", ROOT / "tui" / "ddpdoctor_tui")
HOME = ROOT / "ddpdoctor" / "events" / "environment.py"


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in package.rglob("*.py"))


def test_every_variable_named_in_the_package_is_declared() -> None:
    named = {
        m
        for path in _sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "#define" not in node.value
        for m in re.findall(r"\bDDPDOCTOR_[A-Z_]+[A-Z]\b", node.value)
    }
    assert named, "no DDPDOCTOR_ name found: the scan is broken"
    undeclared = sorted(named - set(VARIABLES))
    assert not undeclared, f"DDPDOCTOR_* names not declared in events/environment.py: {undeclared}"


def _constant_names() -> set[str]:
    """The module-level names that hold one of ddpdoctor's variable names, directly or through
    another such name (``FAULT_ENV = environment.TEST_NATIVE_FAULT_ENV``)."""
    assigns = [
        (target.id, node.value)
        for path in _sources()
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    ]
    names: set[str] = set()
    while True:
        found = {
            name
            for name, value in assigns
            if (isinstance(value, ast.Constant) and value.value in VARIABLES)
            or (isinstance(value, (ast.Name, ast.Attribute)) and ast.unparse(value).split(".")[-1] in names)
        }
        if found <= names:
            return names
        names |= found


def test_only_the_environment_module_reads_ddpdoctors_variables() -> None:
    """No ``os.environ.get(X)`` / ``os.getenv(X)`` where X is one of ddpdoctor's names."""
    ours = _constant_names() | set(VARIABLES)
    assert {"ENDPOINT_ENV", "FAIL_ENV", "TEST_OFFSET_ENV"} <= ours, "the name scan is broken"
    readers = []
    for path in _sources():
        if path == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            if ast.unparse(node.func) not in ("os.environ.get", "os.getenv", "environ.get"):
                continue
            arg = node.args[0]
            spelled = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg).split(".")[-1]
            if spelled in ours:
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not readers, "read ddpdoctor's variables through events.environment.read:\n" + "\n".join(readers)


def test_every_variable_is_in_the_commands_reference() -> None:
    page = (ROOT / "docs" / "reference" / "commands.md").read_text()
    missing = [name for name in VARIABLES if f"`{name}`" not in page]
    assert not missing, f"variables missing from docs/reference/commands.md: {missing}"


def test_read_gives_the_default_for_unset_or_blank_and_refuses_an_undeclared_name() -> None:
    assert read("DDPDOCTOR_LOG", {}) == "compact"
    assert read("DDPDOCTOR_LOG", {"DDPDOCTOR_LOG": "  "}) == "compact"
    assert read("DDPDOCTOR_LOG", {"DDPDOCTOR_LOG": " full "}) == "full"
    assert read("DDPDOCTOR_RUN_DIR", {}) == ""
    assert turned_off("DDPDOCTOR_NATIVE", {"DDPDOCTOR_NATIVE": "Off"})
    assert not turned_off("DDPDOCTOR_NATIVE", {})
    with pytest.raises(KeyError):
        read("DDPDOCTOR_NOT_A_SETTING", {})
