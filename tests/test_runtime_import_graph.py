"""The runtime's modules import one another without a loop (read from the source with ``ast``).

Every import counts: module level, inside functions, and under ``TYPE_CHECKING``. A loop would
make the import order matter and hide which module a change belongs in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "ddpdoctor" / "runtime"
PACKAGE = "ddpdoctor.runtime"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: Path, root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(package.rglob("*.py"))}


def _imported(tree: ast.AST, here: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``tree`` imports by name (a package's ``__init__`` only where
    the package itself, not one of its modules, is what the statement names)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = here.split(".") if is_package else here.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    found.add(full)  # ``from package import module``
                elif base in known:
                    found.add(base)  # ``from module import name``
    found.discard(here)
    return found


def import_graph(package: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """Each module under ``package`` (named from ``root``) and those of them it imports."""
    modules = _modules(package, root)
    known = set(modules)
    return {
        name: _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph`` as the modules along it (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                loop = visit(nxt)
                if loop is not None:
                    return loop
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            loop = visit(node)
            if loop is not None:
                return loop
    return None


def test_the_runtime_has_no_import_loop() -> None:
    graph = import_graph(RUNTIME)
    assert f"{PACKAGE}.monitor" in graph and f"{PACKAGE}.step.hooks" in graph  # (the walk found the tree)
    loop = find_cycle(graph)
    assert loop is None, "import loop: " + " -> ".join(loop or [])


@pytest.mark.parametrize(
    ("files", "loop"),
    [
        ({"a.py": "from pkg import b\n", "b.py": "import pkg.a\n"}, True),
        ({"a.py": "from pkg.b import thing\n", "b.py": "def f():\n    from . import a\n"}, True),
        ({"a.py": "from pkg import b\n", "b.py": "import os\n", "__init__.py": "from pkg.a import x\n"}, False),
    ],
)
def test_the_loop_check_sees_a_loop(tmp_path: Path, files: dict[str, str], loop: bool) -> None:
    """The check itself: a loop written by hand (also a relative one inside a function) is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files.setdefault("__init__.py", "")
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert (find_cycle(import_graph(pkg, tmp_path)) is not None) is loop
